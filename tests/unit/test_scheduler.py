"""The prefill policy of the batching engine, with plain values."""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.scheduler import PrefillPolicy


@dataclass
class Pending:
    n_pending: int
    seconds_per_token: float | None = None


def test_the_shortest_prompt_goes_first() -> None:
    policy = PrefillPolicy()
    assert policy.pick([Pending(6000), Pending(20), Pending(300)]) == 1


def test_a_chunk_fits_the_time_budget() -> None:
    policy = PrefillPolicy(step_tokens=256, budget_s=0.25, min_tokens=8, first_tokens=32)
    assert policy.chunk(Pending(6000)) == 32  # speed not known yet
    assert policy.chunk(Pending(6000, 0.0001)) == 256  # fast (short context): a full step
    assert policy.chunk(Pending(6000, 0.01)) == 25
    assert policy.chunk(Pending(6000, 0.5)) == 8  # slow (long context): never below the minimum
    assert policy.chunk(Pending(5, 0.0001)) == 5  # never more than pending


def test_a_chunk_taken_alone_is_a_full_step_until_it_would_hold_a_newcomer_long() -> None:
    """Alone (nothing decodes or is queued), a chunk is a full step while that takes at most
    ``alone_budget_s``, which bounds what a request arriving mid-prefill waits for the chunk
    under way; deep in a long prompt (slow tokens) it shrinks, never below ``alone_min_tokens``."""
    policy = PrefillPolicy(step_tokens=256, alone_budget_s=1.0, alone_min_tokens=64)
    assert policy.chunk(Pending(9000), alone=True) == 256  # speed not known yet: a full step
    assert policy.chunk(Pending(9000, 0.001), alone=True) == 256  # 1,000 tokens/s: a full step in 0.26 s
    assert policy.chunk(Pending(9000, 1 / 120), alone=True) == 120  # 120 tokens/s: a second's worth
    assert policy.chunk(Pending(9000, 0.1), alone=True) == 64  # 10 tokens/s: the floor
    assert policy.chunk(Pending(40, 0.1), alone=True) == 40  # never more than pending


def test_a_request_refused_after_its_queue_wait_is_told_the_pace_turns_end_at() -> None:
    from app.engine.scheduler import queue_retry_after

    assert queue_retry_after(0, [], now=100.0, max_wait_s=300) == 300  # nothing ended yet: the bound itself
    assert queue_retry_after(0, [90.0], now=100.0, max_wait_s=300) == 300  # one end: no pace yet
    assert queue_retry_after(0, [40.0, 60.0, 80.0], now=100.0, max_wait_s=300) == 20  # a turn each 20 s
    assert queue_retry_after(3, [40.0, 60.0, 80.0], now=100.0, max_wait_s=300) == 80  # four turns ahead
    assert queue_retry_after(0, [1.0, 2.0, 80.0, 81.0], now=100.0, max_wait_s=30) == 1  # old ends left out
    assert queue_retry_after(500, [0.0, 100.0], now=100.0, max_wait_s=300) == 3600  # at most an hour
