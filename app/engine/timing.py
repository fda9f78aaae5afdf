"""Where a turn's time to first token goes, from its HTTP request's arrival: waiting for
the engine thread, restoring its cache, prefilling its prompt. Pure: instants in, seconds out.

Every instant is a ``time.perf_counter()`` reading, taken on whichever thread saw it
(the clock is the process's own, the same on every thread).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A turn's time to first token in its three parts (seconds); they add up to ``ttft_s``."""

    queue_s: float  # arrival until the engine thread took it: reading and rendering it, the queue
    restore_s: float  # its cache brought into memory: a pool tier's files (request thread), the lease
    prefill_s: float  # the lease until its first token: the prompt's new tokens and the first decode step

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.restore_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class TurnClock:
    """The instants of one turn on its way to its first token.

    ``staged_s`` is restore work done on the request thread between arrival and the queue
    (``CacheManager.stage``: a pool tier's files fetched); it counts as restore, not queue.
    """

    arrived: float  # the HTTP request arrived (middleware), or the job was submitted
    taken: float  # the engine thread took the job from the queue
    leased: float  # its working cache was ready (``CacheManager.lease`` returned)
    staged_s: float = 0.0

    def split(self, first_token: float) -> FirstToken:
        """The parts up to ``first_token`` (the instant the first token was generated, or the
        turn's end when it generated none)."""
        waited = max(0.0, self.taken - self.arrived)
        staged = min(max(0.0, self.staged_s), waited)  # staging happened inside the wait
        return FirstToken(queue_s=waited - staged, restore_s=staged + max(0.0, self.leased - self.taken),
                          prefill_s=max(0.0, first_token - max(self.leased, self.taken)))

    def since_arrival(self, instant: float) -> float:
        return max(0.0, instant - self.arrived)


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """A prompt being prefilled: its request, its agent, how many of its new tokens are done."""

    request_id: str
    agent_id: str | None
    done: int
    total: int


LONG_PREFILL_CHUNKS = 4  # a prompt of at least this many prefill chunks logs its progress


def quarter_reached(before: int, after: int, total: int) -> int | None:
    """The last quarter (25, 50 or 75 percent) of ``total`` that a prefill chunk from
    ``before`` to ``after`` tokens crossed, or None (the end is not a quarter: the turn's
    own log line reports it)."""
    if total <= 0 or after >= total:
        return None
    crossed = after * 4 // total
    return crossed * 25 if crossed > before * 4 // total else None
