"""The one thread that owns the model: it loads it, then serves every admitted generation
together (continuous batching).

HTTP threads never touch MLX. They put a job on a bounded queue and read events
from the job's own queue; if this thread dies, readers notice (``Job.events``
raises) instead of hanging. Each loop iteration of this thread:

1. runs cache-manager calls (``Call``), drops queued jobs whose client left, and
   admits queued jobs up to ``max_batch`` (a lease on each one's conversation cache);
   when the oldest waiting job wants another model, nothing behind it is admitted, and
   once the batch has drained the model is swapped (``_swap``);
2. gives every decoding sequence its next token in one batched forward pass;
3. prefills one chunk of one sequence (``scheduler.PrefillPolicy``: the shortest
   prompt first, a time-bounded chunk while others decode).

A sequence that finishes hands its cache back to the cache manager (commit,
4-bit blocks, persistence) before its ``Finished`` event, as a lone one did. The
reader receives ``Finished`` once the cache is on disk (``Job.events`` waits for the
background write, at most ``DURABLE_WAIT_S``): a turn that has ended survives a kill,
reply included, while this thread has already moved on to the next step.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from app.cache.manager import CacheManager
from app.engine.batch import DecodeBatch, prefill
from app.engine.model import LoadedModel, ModelSpec
from app.engine.scheduler import PrefillPolicy
from app.engine.sequence import Sequence
from app.engine.token_text import spells
from app.errors import EngineUnavailable, Overloaded
from app.types import Finished, GenerationEvent, GenerationRequest, Heartbeat, Started

log = logging.getLogger(__name__)

POLL_S = 0.5
# A turn's end is reported once its cache is on disk (a kill right after the reply loses
# nothing), unless writing it takes longer than this.
DURABLE_WAIT_S = 5.0
IDLE_CHECK_S = 10.0  # how often an idle engine looks for caches past their hot TTL


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation raised; ``message`` says why."""

    message: str


@dataclass
class Job:
    """A queued generation and the channel its events come back on."""

    request: GenerationRequest
    runner: "Runner"
    _events: "queue.Queue[GenerationEvent | Failed]" = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    stored: threading.Event | None = None  # set once the turn's cache is on disk (None: not persisted)

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
        ``heartbeat_s``, a ``Heartbeat`` comes after that long without an event.

        Raises:
            EngineUnavailable: the generation failed or the engine thread died.
        """
        last = time.monotonic()
        while True:
            if client_gone is not None and not self.cancelled and client_gone():
                self.cancel()
            try:
                event = self._events.get(timeout=POLL_S)
            except queue.Empty:
                if not self.runner.is_alive():
                    raise EngineUnavailable("the engine thread stopped") from None
                if heartbeat_s is not None and time.monotonic() - last >= heartbeat_s:
                    last = time.monotonic()
                    yield Heartbeat()
                continue
            last = time.monotonic()
            if isinstance(event, Failed):
                raise EngineUnavailable(event.message)
            if isinstance(event, Finished) and self.stored is not None and not self.stored.wait(DURABLE_WAIT_S):
                log.warning("request %s: its cache is not on disk after %.0f s; answering anyway",
                            self.request.request_id, DURABLE_WAIT_S)
            yield event
            if isinstance(event, Finished):
                return


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

    def drop_cancelled(self) -> list[Job]:
        with self._lock:
            gone = [j for j in self._jobs if j.cancelled]
            if gone:
                self._jobs = deque(j for j in self._jobs if not j.cancelled)
        return gone


@dataclass
class EngineCounters:
    """Work the engine thread did since it started (read by /health and /metrics)."""

    decode_steps: int = 0
    split_steps: int = 0  # decode steps split over both CPU cores (``cores.py``)
    decode_tokens: int = 0  # tokens generated by batched decode steps
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    # decode steps and their seconds by the number of sequences in the step
    steps_by_batch: dict[int, int] = field(default_factory=dict)
    seconds_by_batch: dict[int, float] = field(default_factory=dict)

    def snapshot(self) -> "EngineCounters":
        """A copy another thread can read while this one counts on."""
        return replace(self, steps_by_batch=dict(self.steps_by_batch), seconds_by_batch=dict(self.seconds_by_batch))


class Runner(threading.Thread):
    """Loads the default model, then runs admitted generations together; swaps models
    when waiting requests name another one."""

    def __init__(self, load: Callable[[str], LoadedModel], make_caches: Callable[[LoadedModel], CacheManager], *,
                 default: str, max_queue: int, prefill_step_size: int, repetition_penalty: float = 1.0,
                 max_batch: int = 8, memory_bytes: int = 1 << 62) -> None:
        super().__init__(name="semantic-engine", daemon=True)
        self._load = load
        self._make_caches = make_caches
        self._default = default
        self.caches: CacheManager | None = None
        self._queue = JobQueue(max_queue)
        self._calls: queue.Queue[Call | None] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = False
        self._policy = PrefillPolicy(step_tokens=prefill_step_size)
        self._processors = make_logits_processors(repetition_penalty=repetition_penalty) \
            if repetition_penalty != 1.0 else []
        self._max_batch = max_batch
        self._memory_bytes = memory_bytes  # the working caches of admitted sequences stay within it
        self._prefilling: list[Sequence] = []
        self._decoding: dict[int, Sequence] = {}
        self._batch: DecodeBatch | None = None
        self._uids = iter(range(1 << 62))
        self.counters = EngineCounters()
        self.ready = threading.Event()
        self.loaded: LoadedModel | None = None
        self.loading: str | None = None  # the model being loaded
        self.load_error: BaseException | None = None  # the default model failed to load
        self.swaps = 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def n_active(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a generation.

        Raises:
            Overloaded: ``max_queue`` requests already wait.
            EngineUnavailable: the engine thread is not running.
        """
        if not self.is_alive() or not self.ready.is_set():
            raise EngineUnavailable("the engine is not running")
        job = Job(request, self)
        self._queue.put(job)
        self._wake.set()
        return job

    def call(self, fn: Callable[[CacheManager], Any], timeout_s: float = 120) -> Any:
        """Run ``fn(cache_manager)`` on the engine thread and return its result."""
        if not self.is_alive():
            raise EngineUnavailable("the engine is not running")
        call = Call(fn)
        self._calls.put(call)
        self._wake.set()
        return call.result.result(timeout_s)

    def stop(self) -> None:
        """Finish what is admitted and queued, then stop."""
        self._calls.put(None)
        self._wake.set()

    def run(self) -> None:
        try:
            self._install(self._default)
        except BaseException as exc:  # reported to the starter through load_error
            self.load_error = exc
            return
        finally:
            self.ready.set()
        assert self.caches is not None
        while True:
            self._run_calls()
            self._admit()
            if not self.n_active:
                waiting = self._queue.first()
                if waiting is not None and self._model_of(waiting) != self.loaded.name:
                    self._swap(self._model_of(waiting))
                    continue
                if self._stopping and not len(self._queue):
                    break
                self._idle()
                continue
            try:
                self._step()
            except Exception as exc:  # a failed step must not kill the engine: fail what was running
                log.exception("engine step failed")
                self._fail_all(f"generation failed: {exc}")
        self.caches.close()
        self.caches.release_agents()

    def _install(self, name: str) -> None:
        """Load model ``name`` with its own cache manager."""
        self.loading = name
        try:
            loaded = self._load(name)
            self._warm_up(loaded)
            self.caches = self._make_caches(loaded)
            self._batch = DecodeBatch(loaded.model)
            self.loaded = loaded
        finally:
            self.loading = None

    def _swap(self, name: str) -> None:
        """Unload the model (its caches are flushed to disk and stay there) and load ``name``.

        If ``name`` cannot load, the requests waiting for it fail and the previous model
        is loaded again.
        """
        assert self.loaded is not None and self.caches is not None
        previous = self.loaded.name
        log.info("swapping model %s for %s (%d requests waiting)", previous, name, len(self._queue))
        start = time.perf_counter()
        self.caches.close()
        self.loaded = self.caches = self._batch = None
        gc.collect()
        mx.clear_cache()
        try:
            self._install(name)
        except Exception as exc:
            log.exception("model %s failed to load; %s is loaded again", name, previous)
            for job in self._queue.take_all(lambda j: self._model_of(j) == name):
                job.put(Failed(f"model {name} failed to load: {exc}"))
            self._install(previous)
            return
        self.swaps += 1
        log.info("model %s loaded in %.1f s", name, time.perf_counter() - start)

    # -- the loop ---------------------------------------------------------------------------

    def _idle(self) -> None:
        """Nothing to run: wait for work; caches past their hot TTL go warm meanwhile, and
        after a start the recently used conversations come back from disk, one at a time."""
        assert self.caches is not None
        self.caches.expire_hot()
        if self.caches.prefetch():
            return
        self._wake.wait(IDLE_CHECK_S)
        self._wake.clear()

    def _run_calls(self) -> None:
        assert self.caches is not None
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call is None:
                self._stopping = True
                continue
            try:
                call.result.set_result(call.fn(self.caches))
            except Exception as exc:  # handed to the caller
                call.result.set_exception(exc)

    def _admit(self) -> None:
        for job in self._queue.drop_cancelled():
            log.info("request %s: cancelled while queued", job.request.request_id)
            job.put(_cancelled_in_queue(job))
        assert self.loaded is not None
        name = self.loaded.name
        while self.n_active < self._max_batch and \
                (job := self._queue.take(self._can_start, lambda j: self._model_of(j) != name)) is not None:
            if job.cancelled:
                job.put(_cancelled_in_queue(job))
                continue
            try:
                self._prefilling.append(self._start(job))
            except Exception as exc:  # one bad request must not stop the others
                log.exception("request %s could not start", job.request.request_id)
                job.put(Failed(f"generation failed: {exc}"))

    def _model_of(self, job: Job) -> str:
        return job.request.model or self._default

    def _can_start(self, job: Job) -> bool:
        """Whether ``job`` may join the batch now: its conversation is not running (two turns
        of one conversation never share its cache: the later waits for the earlier's commit),
        and its working cache fits beside the running ones' (one always runs)."""
        assert self.loaded is not None
        running = [*self._prefilling, *self._decoding.values()]
        conversation = job.request.conversation_id
        if conversation is not None and any(s.job.request.conversation_id == conversation for s in running):
            return False
        used = sum(working_bytes(s.job.request, self.loaded) for s in running)
        return not running or used + working_bytes(job.request, self.loaded) <= self._memory_bytes

    def _start(self, job: Job) -> Sequence:
        """A lease on the conversation's cache and the prompt tokens still to compute.

        The lease holds the prompt's first tokens exactly as the prompt's own tokenization
        has them (``cache.matcher``), so the rest are the prompt's own tokens too: warm
        computes the token sequence a cold prefill computes (Invariants 2 and 3).
        """
        loaded, caches, request = self.loaded, self.caches, job.request
        assert loaded is not None and caches is not None
        prompt = request.prompt
        lease = caches.lease(request.agent_id, request.conversation_id, prompt, whole_blocks=request.whole_blocks)
        n = lease.n_reused
        assert lease.record.tokens == prompt.token_ids[:n], "a lease reuses the prompt's own tokens"
        start = prompt.ends[n - 1] if n else 0
        ids, ends = prompt.token_ids[n:], tuple(end - start for end in prompt.ends[n:])
        storable = bool(prompt.ends) and spells(loaded.token_bytes, prompt.token_ids, prompt.text)
        sampling = request.sampling
        sequence = Sequence(job, lease, tuple(ids), tuple(ends), storable,
                            max_new=min(sampling.max_tokens, loaded.context_length - lease.n_reused - len(ids)),
                            sampler=make_sampler(temp=sampling.temperature, top_p=sampling.top_p,
                                                 top_k=sampling.top_k if sampling.top_k < loaded.vocab_size else 0),
                            token_bytes=loaded.token_bytes, stop_ids=loaded.stop_token_ids)
        job.put(Started(sequence.n_prompt, lease.n_reused, sequence.n_written))
        return sequence

    def _step(self) -> None:
        assert self.loaded is not None and self._batch is not None
        cores = self.loaded.cores
        if cores is not None:
            cores.use(len(self._batch) > 1)
        self._decode_step()
        if cores is not None and self._prefilling:
            cores.use(False)  # a prefill chunk's large matmuls and attention use OpenBLAS's threads
        self._prefill_step()

    def _decode_step(self) -> None:
        assert self._batch is not None
        if not len(self._batch):
            return
        done = []
        start = time.perf_counter()
        tokens = self._batch.step()
        self.counters.decode_steps += 1
        if self.loaded is not None and self.loaded.cores is not None and self.loaded.cores.active:
            self.counters.split_steps += 1
        elapsed = time.perf_counter() - start
        self.counters.decode_tokens += len(tokens)
        self.counters.decode_s += elapsed
        rows = len(tokens)
        self.counters.steps_by_batch[rows] = self.counters.steps_by_batch.get(rows, 0) + 1
        self.counters.seconds_by_batch[rows] = self.counters.seconds_by_batch.get(rows, 0.0) + elapsed
        for uid, token in tokens:
            if self._decoding[uid].accept(token):
                done.append(uid)
        for uid in done:
            sequence = self._decoding.pop(uid)
            self._finish(sequence, self._batch.remove(uid))

    def _prefill_step(self) -> None:
        for sequence in [s for s in self._prefilling if s.job.cancelled]:
            self._prefilling.remove(sequence)
            log.info("request %s: cancelled during prefill", sequence.job.request.request_id)
            sequence.reason = "cancelled"
            sequence.put(sequence.finished(committed=False))
        if not self._prefilling:
            return
        sequence = self._prefilling[self._policy.pick(self._prefilling)]
        if sequence.n_pending > 0:
            alone = len(self._prefilling) == 1 and not self._decoding and not len(self._queue)
            n = self._policy.chunk(sequence, alone)
            loaded = self.loaded
            assert loaded is not None
            start = time.perf_counter()
            prefill(loaded.model, sequence.cache, sequence.prompt_ids[sequence.n_prefilled:sequence.n_prefilled + n])
            elapsed = time.perf_counter() - start
            sequence.seconds_per_token = elapsed / n
            sequence.n_prefilled += n
            self.counters.prefill_tokens += n
            self.counters.prefill_s += elapsed
        if sequence.n_pending <= 0:
            self._prefilling.remove(sequence)
            if sequence.max_new > 0:
                self._begin_decoding(sequence)
            else:  # prefill only: the cache is the result
                sequence.reason = "max_tokens"
                self._finish(sequence, sequence.cache)

    def _begin_decoding(self, sequence: Sequence) -> None:
        assert self._batch is not None
        uid = next(self._uids)
        self._decoding[uid] = sequence
        self._batch.add(uid, sequence.cache, sequence.prompt_ids[-1], sequence.context_tokens, sequence.sampler,
                        self._processors)

    def _finish(self, sequence: Sequence, cache: list[Any]) -> None:
        """Commit the turn's cache (before ``Finished``: a client that saw its turn end finds
        it committed), then end the job."""
        caches, request = self.caches, sequence.job.request
        assert caches is not None
        if sequence.reason == "cancelled":
            log.info("request %s: cancelled after %d output tokens", request.request_id, len(sequence.output))
        sequence.flush_text()
        committed = sequence.storable and sequence.lease.conversation_id is not None
        if committed:
            lease = sequence.lease
            unreused = request.prompt.text[lease.record.ends[-1] if lease.n_reused else 0:]
            record = lease.record.extend(sequence.prompt_ids, unreused, sequence.prompt_ends) \
                .extend(sequence.output, sequence.tracker.text, sequence.tracker.ends)
            try:
                sequence.job.stored = caches.commit(lease, record, cache, persist=request.persist,
                                                    hot_ttl_s=request.hot_ttl_s)
            except Exception:  # the reply is still good; only reuse is lost
                log.exception("request %s: storing the cache failed", request.request_id)
        sequence.put(sequence.finished(committed))

    def _fail_all(self, message: str) -> None:
        """After a failed step: every running sequence fails (their caches are in doubt)."""
        for sequence in [*self._prefilling, *self._decoding.values()]:
            sequence.put(Failed(message))
        self._prefilling.clear()
        self._decoding.clear()
        assert self.loaded is not None
        self._batch = DecodeBatch(self.loaded.model)

    @staticmethod
    def _warm_up(loaded: LoadedModel) -> None:
        """One tiny forward pass, so the first request does not pay for kernel setup."""
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array([[0, 1, 2, 3]]), cache=cache))


def working_bytes(request: GenerationRequest, model: ModelSpec) -> int:
    """The float working cache a request fills at most: its prompt and its output."""
    n_tokens = min(request.prompt.n_tokens + request.sampling.max_tokens, model.context_length)
    return n_tokens * model.kv_bytes_per_token


def _cancelled_in_queue(job: Job) -> Finished:
    """The end of a job dropped before it started: nothing computed, nothing stored."""
    return Finished(stop_reason="cancelled", stop_sequence=None, n_prompt_tokens=job.request.prompt.n_tokens,
                    n_cached_tokens=0, n_cache_written=0, n_output_tokens=0, ttft_s=0.0, total_s=0.0)
