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


def test_alone_a_prefill_runs_in_full_steps() -> None:
    policy = PrefillPolicy(step_tokens=256)
    assert policy.chunk(Pending(6000, 0.05), others_decoding=False) == 256
    assert policy.chunk(Pending(30), others_decoding=False) == 30


def test_while_others_decode_a_chunk_fits_the_time_budget() -> None:
    policy = PrefillPolicy(step_tokens=256, budget_s=0.25, min_tokens=16, first_tokens=64)
    assert policy.chunk(Pending(6000), others_decoding=True) == 64  # speed not known yet
    assert policy.chunk(Pending(6000, 0.001), others_decoding=True) == 250  # fast: nearly a full step
    assert policy.chunk(Pending(6000, 0.01), others_decoding=True) == 25
    assert policy.chunk(Pending(6000, 0.5), others_decoding=True) == 16  # slow: never below the minimum
    assert policy.chunk(Pending(5, 0.5), others_decoding=True) == 5  # never more than pending
