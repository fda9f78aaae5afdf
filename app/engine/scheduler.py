"""Which prefill runs next, and how much of it, while other sequences decode. Pure.

The engine thread alternates one batched decode step (every decoding sequence
gets a token) with one prefill chunk of one sequence. The chunk is the
shortest remaining prompt's (a hot agent's 20 new tokens go before another
agent's cold 6K-token prompt), and while anything decodes it is sized to take
about ``budget_s`` at the speed its last chunk ran, so a long cold prefill
never stalls the decoding sequences for more than that. Alone, a prefill runs
in full ``step_tokens`` chunks.
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
    budget_s: float = 0.25  # how long a chunk may hold up decoding sequences
    min_tokens: int = 16  # the smallest chunk worth a forward pass
    first_tokens: int = 64  # a chunk whose speed is not known yet, while others decode

    def pick(self, prefilling: Sequence[Prefilling]) -> int:
        """Index of the sequence to prefill next: the least left to do."""
        return min(range(len(prefilling)), key=lambda i: prefilling[i].n_pending)

    def chunk(self, sequence: Prefilling, others_decoding: bool) -> int:
        """Tokens to prefill now for ``sequence`` (at least one, at most what it has pending)."""
        pending = sequence.n_pending
        if not others_decoding:
            return min(pending, self.step_tokens)
        rate = sequence.seconds_per_token
        fit = self.first_tokens if rate is None or rate <= 0 else int(self.budget_s / rate)
        return max(1, min(pending, self.step_tokens, max(self.min_tokens, fit)))
