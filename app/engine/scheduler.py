"""Which prefill runs next, and how much of it. Pure.

The engine thread alternates one batched decode step (every decoding sequence
gets a token) with one prefill chunk of one sequence. The chunk is the
shortest remaining prompt's (a hot agent's 20 new tokens go before another
agent's cold 6K-token prompt), and it is sized to take about ``budget_s`` at
the speed the sequence's last chunk ran: a request that arrives during a long
cold prefill waits at most about that long for its own turn, and decoding
sequences get a token at least that often. Small chunks cost little: on the
2-core CPU a prefill's time per token is set by the context it attends to, not
by the chunk (512 tokens at 2K context took 6.0 s in 256-token chunks and 6.15 s
in 32-token chunks).
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
    step_tokens: int = 256  # the largest chunk (bounds peak memory)
    budget_s: float = 0.25  # about how long one chunk may take
    min_tokens: int = 8  # the smallest chunk
    first_tokens: int = 32  # a sequence's first chunk, its speed not known yet

    def pick(self, prefilling: Sequence[Prefilling]) -> int:
        """Index of the sequence to prefill next: the least left to do."""
        return min(range(len(prefilling)), key=lambda i: prefilling[i].n_pending)

    def chunk(self, sequence: Prefilling) -> int:
        """Tokens to prefill now for ``sequence`` (at least one, at most what it has pending)."""
        rate = sequence.seconds_per_token
        fit = self.first_tokens if rate is None or rate <= 0 else int(self.budget_s / rate)
        return max(1, min(sequence.n_pending, self.step_tokens, max(self.min_tokens, fit)))
