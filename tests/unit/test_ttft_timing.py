"""A turn's time to first token, from its request's arrival, in its three parts (pure arithmetic)."""

from __future__ import annotations

import pytest

from app.engine.timing import FirstToken, TurnClock, quarter_reached


def test_the_parts_add_up_to_the_time_from_arrival_to_the_first_token() -> None:
    # arrived at 10.0; 0.3 s of it restoring files from a pool's tier before the queue;
    # taken by the engine at 11.0; the lease (files from disk, working copy) ready at 13.5;
    # first token at 14.0.
    clock = TurnClock(arrived=10.0, taken=11.0, leased=13.5, staged_s=0.3)
    parts = clock.split(first_token=14.0)
    assert parts.queue_s == pytest.approx(0.7)
    assert parts.restore_s == pytest.approx(0.3 + 2.5)
    assert parts.prefill_s == pytest.approx(0.5)
    assert parts.ttft_s == pytest.approx(4.0)  # 14.0 - 10.0: what the client waited, not the 0.5 s of prefill


def test_a_turn_taken_at_once_from_a_hot_cache_is_all_prefill() -> None:
    parts = TurnClock(arrived=5.0, taken=5.0, leased=5.0).split(5.25)
    assert parts == FirstToken(queue_s=0.0, restore_s=0.0, prefill_s=0.25)


def test_staging_never_counts_twice_nor_makes_the_queue_negative() -> None:
    # a staging time longer than the whole wait (clocks read on two threads) is capped by it
    parts = TurnClock(arrived=1.0, taken=1.2, leased=1.5, staged_s=0.5).split(2.0)
    assert parts.queue_s == 0.0 and parts.restore_s == pytest.approx(0.2 + 0.3)
    assert parts.ttft_s == pytest.approx(1.0)
    assert TurnClock(arrived=3.0, taken=3.0, leased=3.1).since_arrival(4.5) == pytest.approx(1.5)


@pytest.mark.parametrize("before,after,total,quarter", [
    (0, 256, 1024, 25), (256, 512, 1024, 50), (0, 600, 1024, 50), (512, 767, 1024, None), (700, 1000, 1024, 75),
    (768, 1024, 1024, None), (0, 100, 1000, None), (0, 10, 0, None)])
def test_a_prefill_chunk_reports_the_quarter_it_crossed(before: int, after: int, total: int,
                                                        quarter: int | None) -> None:
    assert quarter_reached(before, after, total) == quarter
