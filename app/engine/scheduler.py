"""Which prefill runs next, and how much of it. Pure.

The engine thread alternates one batched decode step (every decoding sequence
gets a token) with one prefill chunk of one sequence. The chunk is the
shortest remaining prompt's (a hot conversation's 20 new tokens go before
another's cold 6K-token prompt).

A sequence prefilling alone (nothing decodes, nothing waits in the queue) takes
chunks of ``step_tokens``, the size that is fastest on the machine (small chunks
pay a fixed cost per forward pass: a chunk of 8 tokens runs at half the speed of
one of 256, and a bigger model reads more weights per pass), as long as one takes
at most about ``alone_budget_s``: deep in a long prompt, where a token costs more,
the chunk shrinks (to ``alone_min_tokens`` at least), since a request that arrives
meanwhile waits for the chunk under way. Longer prefills paused behind a sequence
count as nothing waiting: shortest-first runs it before them whatever its chunks,
so a title request that arrives during a long cold prefill takes the chunks it
would alone. While a sequence decodes or a request is queued, the chunk is sized
to take about ``budget_s`` at the speed the sequence's last chunk ran: decoding
sequences get a token at least that often, and the queued one starts soon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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
    alone_budget_s: float = 1.0  # about how long a chunk taken alone may take (what a new request waits)
    alone_min_tokens: int = 64  # the smallest chunk taken alone (each pass reads every weight once)

    def pick(self, prefilling: Sequence[Prefilling]) -> int:
        """Index of the sequence to prefill next: the least left to do."""
        return min(range(len(prefilling)), key=lambda i: prefilling[i].n_pending)

    def chunk(self, sequence: Prefilling, alone: bool = False) -> int:
        """Tokens to prefill now for ``sequence`` (at least one, at most what it has pending);
        ``alone``: nothing decodes and nothing is queued."""
        rate = sequence.seconds_per_token
        if alone:
            fit = self.step_tokens if rate is None or rate <= 0 else max(self.alone_min_tokens,
                                                                          int(self.alone_budget_s / rate))
        else:
            fit = self.first_tokens if rate is None or rate <= 0 else int(self.budget_s / rate)
        return max(1, min(sequence.n_pending, self.step_tokens, max(self.min_tokens, fit)))


def queue_retry_after(place: int, finishes: Sequence[float], now: float, max_wait_s: float) -> int:
    """Seconds a request that waited too long in the queue should wait before trying again:
    the ``place + 1`` turns ahead of it at the pace turns ended lately (``finishes``: when the
    last ones ended, oldest first, within ``max_wait_s`` of ``now``), or ``max_wait_s`` when too
    few ended to tell. At least 1, at most an hour."""
    recent = [t for t in finishes if now - t <= max_wait_s]
    if len(recent) < 2:
        estimate = max_wait_s
    else:
        estimate = (place + 1) * (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(1, min(3600, round(estimate)))
