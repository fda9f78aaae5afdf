"""The one thread that owns the model: it loads it, then runs queued generations.

HTTP threads never touch MLX. They put a job on the queue and read events from
the job's own queue; if this thread dies, readers notice (``Job.events``
raises) instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from app.cache.manager import CacheManager, Lease
from app.engine.model import LoadedModel
from app.engine.prompting import tokenize_with_ends
from app.engine.stopping import EndMatcher, StopMatcher
from app.engine.token_text import TextTracker, spells
from app.errors import EngineUnavailable, Overloaded
from app.types import Finished, GenerationEvent, GenerationRequest, Started, StopReason, TextDelta

log = logging.getLogger(__name__)

POLL_S = 0.5
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

    def cancel(self) -> None:
        """Stop generating at the next token (the client went away)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event: GenerationEvent | Failed) -> None:
        self._events.put(event)

    def events(self, client_gone: Callable[[], bool] | None = None) -> Iterator[GenerationEvent]:
        """Events as the engine produces them, ending with ``Finished``.

        ``client_gone`` is polled while waiting: once it says the client left, the
        job is cancelled (dropped if still queued, stopped between prefill chunks
        or at the next token) and the events end with a cancelled ``Finished``.

        Raises:
            EngineUnavailable: the generation failed or the engine thread died.
        """
        while True:
            if client_gone is not None and not self.cancelled and client_gone():
                self.cancel()
            try:
                event = self._events.get(timeout=POLL_S)
            except queue.Empty:
                if not self.runner.is_alive():
                    raise EngineUnavailable("the engine thread stopped") from None
                continue
            if isinstance(event, Failed):
                raise EngineUnavailable(event.message)
            yield event
            if isinstance(event, Finished):
                return


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the job was cancelled."""


@dataclass(frozen=True)
class Call:
    """Work on the cache manager that must run on the engine thread (between generations)."""

    fn: Callable[[CacheManager], Any]
    result: Future = field(default_factory=Future)


class Runner(threading.Thread):
    """Loads the model, then generates for one job at a time, in queue order."""

    def __init__(self, load: Callable[[], LoadedModel], make_caches: Callable[[LoadedModel], CacheManager], *,
                 max_queue: int, prefill_step_size: int, repetition_penalty: float = 1.0) -> None:
        super().__init__(name="semantic-engine", daemon=True)
        self._load = load
        self._make_caches = make_caches
        self.caches: CacheManager | None = None
        self._jobs: queue.Queue[Job | Call | None] = queue.Queue(maxsize=max_queue)
        self._prefill_step_size = prefill_step_size
        self._processors = make_logits_processors(repetition_penalty=repetition_penalty) \
            if repetition_penalty != 1.0 else None
        self.ready = threading.Event()
        self.loaded: LoadedModel | None = None
        self.load_error: BaseException | None = None
        self.n_active = 0

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a generation.

        Raises:
            Overloaded: the queue is full.
            EngineUnavailable: the engine thread is not running.
        """
        if not self.is_alive() or self.loaded is None:
            raise EngineUnavailable("the engine is not running")
        job = Job(request, self)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"{self._jobs.maxsize} requests are already waiting") from None
        return job

    def call(self, fn: Callable[[CacheManager], Any], timeout_s: float = 120) -> Any:
        """Run ``fn(cache_manager)`` on the engine thread and return its result."""
        if not self.is_alive():
            raise EngineUnavailable("the engine is not running")
        call = Call(fn)
        self._jobs.put(call)
        return call.result.result(timeout_s)

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        try:
            self.loaded = self._load()
            self._warm_up(self.loaded)
            self.caches = self._make_caches(self.loaded)
        except BaseException as exc:  # reported to the starter through load_error
            self.load_error = exc
            return
        finally:
            self.ready.set()
        assert self.caches is not None
        while (job := self._next()) is not None:
            if isinstance(job, Call):
                try:
                    job.result.set_result(job.fn(self.caches))
                except Exception as exc:  # handed to the caller
                    job.result.set_exception(exc)
                continue
            if job.cancelled:  # the client left while it waited
                log.info("request %s: cancelled while queued", job.request.request_id)
                job.put(_cancelled(job.request.prompt.n_tokens, 0, 0.0))
                continue
            self.n_active = 1
            try:
                self._generate(job)
            except Exception as exc:  # one failed generation must not kill the engine
                log.exception("generation %s failed", job.request.request_id)
                job.put(Failed(f"generation failed: {exc}"))
            finally:
                self.n_active = 0
        self.caches.close()

    def _next(self) -> Job | Call | None:
        """The next queued item; while idle, caches past their hot TTL go warm."""
        assert self.caches is not None
        while True:
            self.caches.expire_hot()
            try:
                return self._jobs.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                continue

    @staticmethod
    def _warm_up(loaded: LoadedModel) -> None:
        """One tiny forward pass, so the first request does not pay for kernel setup."""
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array([[0, 1, 2, 3]]), cache=cache))

    def _lease(self, job: Job) -> tuple[Lease, tuple[int, ...], tuple[int, ...], bool]:
        """The working cache and the prompt tokens still to prefill.

        Returns (lease, token ids, their ends relative to the unreused text,
        whether the resulting record may be stored). Reuse is taken only if the
        reused tokens plus the new ones spell the prompt exactly (Invariant 2).
        """
        loaded, caches, request = self.loaded, self.caches, job.request
        assert loaded is not None and caches is not None
        prompt = request.prompt
        lease = caches.lease(request.agent_id, request.conversation_id, prompt, whole_blocks=request.whole_blocks)
        if lease.n_reused:
            start = lease.record.ends[-1]
            ids, ends = tokenize_with_ends(loaded.tokenizer, prompt.text[start:])
            if spells(loaded.token_bytes, lease.record.tokens + ids, prompt.text):
                return lease, ids, ends, True
            log.warning("request %s: suffix tokens do not spell the prompt; prefilling cold", request.request_id)
            lease = caches.cold(lease.agent_id, lease.conversation_id,
                                replace(lease.report, reason="respell", n_chars=0))
        exact = bool(prompt.ends) and spells(loaded.token_bytes, prompt.token_ids, prompt.text)
        return lease, prompt.token_ids, prompt.ends, exact

    def _generate(self, job: Job) -> None:
        loaded, caches = self.loaded, self.caches
        assert loaded is not None and caches is not None
        request = job.request
        started = time.perf_counter()
        lease, prompt_ids, prompt_ends, storable = self._lease(job)
        n_prompt = lease.n_reused + len(prompt_ids)
        n_written = len(prompt_ids) if storable and lease.conversation_id is not None else 0
        job.put(Started(n_prompt, lease.n_reused, n_written))
        sampling = request.sampling
        max_new = min(sampling.max_tokens, loaded.context_length - n_prompt)
        sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        tracker = TextTracker(loaded.token_bytes)
        stops = StopMatcher(sampling.stop_sequences)
        ends = EndMatcher(sampling.end_after)
        output: list[int] = []
        ttft = 0.0
        reason: StopReason = "max_tokens"
        stop_sequence: str | None = None
        def check_cancelled(_done: int, _total: int) -> None:
            if job.cancelled:
                raise PrefillCancelled

        steps = generate_step(mx.array(prompt_ids), loaded.model, max_tokens=max_new, sampler=sampler,
                              logits_processors=self._processors, prompt_cache=lease.cache,
                              prefill_step_size=self._prefill_step_size, prompt_progress_callback=check_cancelled)
        try:
            first = next(steps, None)
        except PrefillCancelled:
            log.info("request %s: cancelled during prefill", request.request_id)
            job.put(_cancelled(n_prompt, lease.n_reused, time.perf_counter() - started))
            return
        for token, _ in itertools.chain([first] if first is not None else [], steps):
            token = int(token)
            if not output:
                ttft = time.perf_counter() - started
            output.append(token)  # every yielded token has been fed to the cache
            text = tracker.add(token)
            if job.cancelled:
                reason = "cancelled"
                break
            if token in loaded.stop_token_ids:
                reason = "end_turn"
                break
            check = stops.feed(text)
            if check.emit:
                job.put(TextDelta(check.emit))
            if check.stop_sequence is not None:
                reason, stop_sequence = "stop_sequence", check.stop_sequence
                break
            if ends.feed(text):
                reason = "end_turn"
                break
        if reason == "cancelled":
            log.info("request %s: cancelled after %d output tokens", request.request_id, len(output))
        tail = tracker.finish()
        if reason == "max_tokens":
            check = stops.feed(tail)
            if check.stop_sequence is not None:
                reason, stop_sequence = "stop_sequence", check.stop_sequence
            rest = check.emit if check.stop_sequence else check.emit + stops.flush()
            if rest:
                job.put(TextDelta(rest))
        elif reason == "end_turn" and (held := stops.flush()):
            job.put(TextDelta(held))
        total = time.perf_counter() - started
        if storable:  # before Finished: a client that saw its turn end finds the cache committed
            unreused = request.prompt.text[lease.record.ends[-1] if lease.n_reused else 0:]
            record = lease.record.extend(prompt_ids, unreused, prompt_ends).extend(output, tracker.text, tracker.ends)
            try:
                caches.commit(lease, record, lease.cache, persist=request.persist, hot_ttl_s=request.hot_ttl_s)
            except Exception:  # the reply is still good; only reuse is lost
                log.exception("request %s: storing the cache failed", request.request_id)
        job.put(Finished(
            stop_reason=reason, stop_sequence=stop_sequence,
            n_prompt_tokens=n_prompt, n_cached_tokens=lease.n_reused, n_cache_written=n_written,
            n_output_tokens=len(output), ttft_s=ttft, total_s=total,
            match_outcome=lease.outcome, output_token_ids=tuple(output), reuse=lease.report,
        ))


def _cancelled(n_prompt: int, n_cached: int, total_s: float) -> Finished:
    """The end of a generation cancelled before its first token: nothing generated, nothing stored."""
    return Finished(stop_reason="cancelled", stop_sequence=None, n_prompt_tokens=n_prompt, n_cached_tokens=n_cached,
                    n_cache_written=0, n_output_tokens=0, ttft_s=0.0, total_s=total_s)
