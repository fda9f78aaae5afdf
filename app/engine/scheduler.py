"""Which prefill runs next, and how much of it. Pure.

The engine thread alternates one batched decode step (every decoding sequence
gets a token) with one prefill chunk of one sequence. The chunk is the
shortest remaining prompt's (a hot conversation's 20 new tokens go before
another's cold 6K-token prompt).

A sequence prefilling alone (nothing decodes, nothing else waits) takes chunks
of ``step_tokens``, the size that is fastest on the machine: small chunks pay a
fixed cost per forward pass (a chunk of 8 tokens runs at half the speed of one
of 256). While others wait, the chunk is sized to take about ``budget_s`` at the
speed the sequence's last chunk ran: a request that arrives during a long cold
prefill waits at most about that long for its own turn, and decoding sequences
get a token at least that often.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class Prefilling(Protocol):
    @property
    def n_pending(self) -> int: ...

    @property
    def seconds_per_token(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    step_tokens: int = 256  # the largest chunk, taken when alone (bounds peak memory)
    budget_s: float = 0.25  # about how long one chunk may take
    min_tokens: int = 8  # the smallest chunk
    first_tokens: int = 32  # a sequence's first chunk, its speed not known yet

    def pick(self, prefilling: Sequence[Prefilling]) -> int:
        """Index of the sequence to prefill next: the least left to do."""
        return min(range(len(prefilling)), key=lambda i: prefilling[i].n_pending)

    def chunk(self, sequence: Prefilling, alone: bool = False) -> int:
        """Tokens to prefill now for ``sequence`` (at least one, at most what it has pending);
        ``alone``: no other sequence is running or waiting."""
        rate = sequence.seconds_per_token
        if alone:
            fit = self.step_tokens
        else:
            fit = self.first_tokens if rate is None or rate <= 0 else int(self.budget_s / rate)
        return max(1, min(sequence.n_pending, self.step_tokens, max(self.min_tokens, fit)))
