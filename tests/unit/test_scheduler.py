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
