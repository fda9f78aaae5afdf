"""The job channel between HTTP threads and the engine thread. No MLX.

An HTTP thread puts a ``Job`` on the ``JobQueue`` and reads its events from the job's own
queue; work on the cache manager goes over as a ``Call``. If the engine thread dies,
readers notice (``Job.events`` raises) instead of hanging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.errors import EngineUnavailable, Overloaded, SemanticError
from app.types import Finished, GenerationEvent, GenerationRequest, Heartbeat

if TYPE_CHECKING:
    from app.cache.manager import CacheManager

log = logging.getLogger(__name__)

POLL_S = 0.5
PROGRESS_S = 1.0  # a stream's prefill progress, at most this often


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation raised, or was refused: ``message`` says why; ``error``, if given, is
    what the reader raises (else EngineUnavailable)."""

    message: str
    error: SemanticError | None = None


@dataclass
class Job:
    """A queued generation and the channel its events come back on; ``alive`` says whether
    the engine thread that will answer it still runs."""

    request: GenerationRequest
    alive: Callable[[], bool]
    _events: queue.Queue[GenerationEvent | Failed] = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # Its prefill's progress, (prompt tokens in the cache, the prompt's), set by the engine
    # thread after each chunk (one tuple, replaced whole); None before it starts.
    progress: tuple[int, int] | None = None

    @property
    def arrived(self) -> float:
        """When its time to first token starts: its HTTP request's arrival, else its submission."""
        arrived = self.request.arrived_at
        return self.submitted if arrived is None else arrived

    def cancel(self) -> None:
        """Stop as soon as possible (the client went away): dropped if still queued, stopped
        between prefill chunks, or removed from the batch at the next token."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event: GenerationEvent | Failed) -> None:
        self._events.put(event)

    def events(self, client_gone: Callable[[], bool] | None = None,
               heartbeat_s: float | None = None) -> Iterator[GenerationEvent]:
        """Events as the engine produces them, ending with ``Finished``.

        ``client_gone`` is polled while waiting: once it says the client left, the
        job is cancelled and the events end with a cancelled ``Finished``. With
        ``heartbeat_s``, a ``Heartbeat`` comes after that long without an event, and one
        carrying the prefill's progress each time it moved, ``PROGRESS_S`` apart at most.

        Raises:
            EngineUnavailable: the generation failed or the engine thread died.
            QueueTimeout: it waited ``max_queue_wait_s`` without starting.
        """
        last = time.monotonic()
        shown = None  # the progress the last heartbeat carried
        while True:
            if client_gone is not None and not self.cancelled and client_gone():
                self.cancel()
            try:
                event = self._events.get(timeout=POLL_S)
            except queue.Empty:
                if not self.alive():
                    raise EngineUnavailable("the engine thread stopped") from None
                waited, progress = time.monotonic() - last, self.progress
                if heartbeat_s is not None and (waited >= heartbeat_s
                                                or (progress != shown and waited >= PROGRESS_S)):
                    last, shown = time.monotonic(), progress
                    yield Heartbeat(*(progress or (0, 0)))
                continue
            last = time.monotonic()
            if isinstance(event, Failed):
                raise event.error if event.error is not None else EngineUnavailable(event.message)
            yield event
            if isinstance(event, Finished):
                return


def cancelled_in_queue(job: Job) -> Finished:
    """The end of a job dropped before it started: nothing computed, nothing stored."""
    waited = max(0.0, time.perf_counter() - job.arrived)
    return Finished(stop_reason="cancelled", stop_sequence=None, n_prompt_tokens=job.request.prompt.n_tokens,
                    n_cached_tokens=0, n_cache_written=0, n_output_tokens=0, ttft_s=0.0, total_s=waited,
                    queue_s=waited)


@dataclass(frozen=True)
class Call:
    """Work on the cache manager that must run on the engine thread (between steps)."""

    fn: Callable[[CacheManager], Any]
    result: Future = field(default_factory=Future)


class JobQueue:
    """Jobs waiting for a place in the batch: bounded, and a job whose client left is
    dropped from anywhere in it (it holds no place)."""

    def __init__(self, max_waiting: int) -> None:
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self.max_waiting = max_waiting

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: Job) -> None:
        """Raises Overloaded when ``max_waiting`` jobs already wait."""
        with self._lock:
            if sum(not j.cancelled for j in self._jobs) >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests are already waiting")
            self._jobs.append(job)

    def take(self, ready: Callable[[Job], bool], barrier: Callable[[Job], bool] = lambda _: False) -> Job | None:
        """The first waiting job that is ``ready`` to start (others keep their places),
        looking no further than the first job that is a ``barrier``."""
        with self._lock:
            for job in self._jobs:
                if barrier(job) and not job.cancelled:
                    return None
                if ready(job):
                    self._jobs.remove(job)
                    return job
            return None

    def first(self) -> Job | None:
        """The oldest waiting job whose client has not left."""
        with self._lock:
            return next((j for j in self._jobs if not j.cancelled), None)

    def take_all(self, which: Callable[[Job], bool]) -> list[Job]:
        with self._lock:
            taken = [j for j in self._jobs if which(j)]
            self._jobs = deque(j for j in self._jobs if not which(j))
        return taken

    def take_expired(self, max_wait_s: float, now: float) -> list[tuple[int, Job]]:
        """The jobs that have waited over ``max_wait_s`` since they arrived (by
        ``time.perf_counter``), taken out, each with its place in the queue (0: first)."""
        with self._lock:
            expired = [(i, j) for i, j in enumerate(self._jobs) if now - j.arrived > max_wait_s]
            if expired:
                self._jobs = deque(j for j in self._jobs if now - j.arrived <= max_wait_s)
        return expired

    def drop_cancelled(self) -> list[Job]:
        with self._lock:
            gone = [j for j in self._jobs if j.cancelled]
            if gone:
                self._jobs = deque(j for j in self._jobs if not j.cancelled)
        return gone
