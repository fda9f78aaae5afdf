"""The engine thread: it owns the model, its cache manager and every generation in flight,
and runs the admitted ones together (continuous batching).

HTTP threads never touch MLX nor anything this thread owns: they hand it jobs and calls
over the channel (``channel.py``) and read what it publishes (``RunnerSnapshot``, replaced
whole, never changed). Each loop iteration of this thread:

1. runs cache-manager calls (``Call``), drops queued jobs whose client left, and
   admits queued jobs (``admission.Admission``; a lease on each one's conversation cache);
   when the oldest waiting job wants another model, nothing behind it is admitted, and
   once the batch has drained the model is swapped (``_swap``);
2. gives every decoding sequence its next token in one batched forward pass;
3. prefills one chunk of one sequence (``scheduler.PrefillPolicy``: the shortest
   prompt first, a time-bounded chunk while others decode).

A sequence that finishes sends its ``Finished`` event, then hands its cache back to the
cache manager (commit, quantized blocks, persistence) before this thread does anything
else. The turn's history is committed before its reply ends (``api/generation.py``),
which is what must survive a kill; the cache is written in the background
(``cache/persist.py``: files, then the index row that names them), and a kill before
that costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from app.cache.hashing import BLOCK_TOKENS
from app.cache.manager import CacheManager
from app.engine.admission import Admission
from app.engine.batch import DecodeBatch, prefill
from app.engine.channel import Call, Failed, Job, JobQueue, cancelled_in_queue
from app.engine.drafting import DraftSource
from app.engine.model import LoadedModel
from app.engine.sampling import token_logprobs
from app.engine.scheduler import PrefillPolicy, queue_retry_after
from app.engine.sequence import Sequence
from app.engine.surface import EngineCounters
from app.engine.timing import LONG_PREFILL_CHUNKS, PrefillProgress, TurnClock, quarter_reached
from app.errors import EngineUnavailable, QueueTimeout
from app.types import CacheStats, GenerationRequest, Started

log = logging.getLogger(__name__)

IDLE_CHECK_S = 10.0  # how often an idle engine looks for caches past their hot TTL


@dataclass(frozen=True, slots=True)
class RunnerSnapshot:
    """What the engine thread last published for other threads to read."""

    loaded: LoadedModel | None = None  # read for its spec (frozen) only: its weights are this thread's
    loading: str | None = None  # the model being loaded
    n_active: int = 0
    cache: CacheStats | None = None
    hot: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # agent -> conversation -> tokens
    counters: EngineCounters = field(default_factory=EngineCounters)
    swaps: int = 0  # models swapped in since start
    prefills: tuple[PrefillProgress, ...] = ()  # the prompts being prefilled


class Runner(threading.Thread):
    """Loads the default model, then runs admitted generations together; swaps models
    when waiting requests name another one."""

    def __init__(self, load: Callable[[str], LoadedModel], make_caches: Callable[[LoadedModel], CacheManager], *,
                 default: str, max_queue: int, prefill_step_size: int, admission: Admission,
                 repetition_penalty: float = 1.0, speculative_tokens: int = 0,
                 load_draft: Callable[[LoadedModel], DraftSource] | None = None,
                 max_queue_wait_s: float = 300, prefill_checkpoint_s: float = 0) -> None:
        super().__init__(name="semantic-engine", daemon=True)
        self._load = load
        self._load_draft = load_draft  # a loaded model's draft model (draft_model.py), or None
        self._drafts: DraftSource | None = None
        self._make_caches = make_caches
        self._default = default
        self._caches: CacheManager | None = None
        self._queue = JobQueue(max_queue)
        self._max_queue_wait_s = max_queue_wait_s
        self._prefill_checkpoint_s = prefill_checkpoint_s  # 0: a prefill stores nothing until it ends
        self._finishes: deque[float] = deque(maxlen=16)  # when the last turns ended (perf_counter)
        self._calls: queue.Queue[Call | None] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = False
        self._policy = PrefillPolicy(step_tokens=prefill_step_size)
        self._processors = make_logits_processors(repetition_penalty=repetition_penalty) \
            if repetition_penalty != 1.0 else []
        self._admission = admission
        self._speculative_tokens = speculative_tokens  # the longest draft (0: no speculation)
        self._prefilling: list[Sequence] = []
        self._decoding: dict[int, Sequence] = {}
        self._batch: DecodeBatch | None = None
        self._uids = iter(range(1 << 62))
        self._counters = EngineCounters()
        self._swaps = 0
        self._loading: str | None = None  # the model being loaded
        self.ready = threading.Event()
        self._loaded: LoadedModel | None = None
        self.load_error: BaseException | None = None  # the default model failed to load
        self.snapshot = RunnerSnapshot()  # replaced by this thread (``_publish``), read by any

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
        job = Job(request, self.is_alive)
        self._queue.put(job)
        self._wake.set()
        return job

    def call(self, fn: Callable[[CacheManager], Any], timeout_s: float = 120) -> Any:
        """Run ``fn(cache_manager)`` on the engine thread and return its result.

        Raises:
            EngineUnavailable: the engine is not running, or did not take the call within
                ``timeout_s`` (then it never runs: the call is cancelled).
        """
        if not self.is_alive():
            raise EngineUnavailable("the engine is not running")
        call = Call(fn)
        self._calls.put(call)
        self._wake.set()
        try:
            return call.result.result(timeout_s)
        except FutureTimeout:
            if call.result.cancel():
                raise EngineUnavailable(f"the engine did not take the call within {timeout_s:g} s") from None
            return call.result.result()  # it is running: its result is moments away

    def stop(self) -> None:
        """Finish what is admitted and queued, then stop."""
        self._calls.put(None)
        self._wake.set()

    def cancel_all(self) -> None:
        """Cancel every queued and running generation (the server is stopping now), without
        waiting: on this thread's next turn, queued jobs end cancelled and running ones stop at
        their next token or prefill chunk, as when their clients leave."""
        self._calls.put(Call(lambda _caches: self._cancel_all()))
        self._wake.set()

    def _cancel_all(self) -> None:
        for sequence in [*self._prefilling, *self._decoding.values()]:
            sequence.job.cancel()
        for job in self._queue.take_all(lambda _job: True):
            job.cancel()
            log.info("request %s: cancelled while queued (the server is stopping)", job.request.request_id)
            job.put(cancelled_in_queue(job))

    def run(self) -> None:
        try:
            self._install(self._default)
        except BaseException as exc:  # reported to the starter through load_error
            self.load_error = exc
            return
        finally:
            self.ready.set()
        assert self._caches is not None
        while True:
            self._run_calls()
            self._admit()
            self._publish()
            if not self.n_active:
                waiting = self._queue.first()
                if waiting is not None and self._loaded is not None and self._model_of(waiting) != self._loaded.name:
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
        if self._loaded is not None and self._loaded.cores is not None:
            self._loaded.cores.use(False)  # OpenBLAS's threads back for whatever runs in this process next
        self._caches.close()
        self._caches.release_agents()

    def _publish(self) -> None:
        """Replace the snapshot other threads read (called between steps, after a finished
        turn's commit, and before a call's result is handed over, so its reader sees what it did)."""
        caches = self._caches
        hot = MappingProxyType({agent: MappingProxyType(conversations)
                                for agent, conversations in caches.hot_by_agent().items()}) if caches else {}
        prefills = tuple(PrefillProgress(s.job.request.request_id, s.job.request.agent_id, s.n_prefilled,
                                         len(s.prompt_ids)) for s in self._prefilling)
        self.snapshot = RunnerSnapshot(self._loaded, self._loading, self.n_active, caches.stats() if caches else None,
                                       hot, self._counters, self._swaps, prefills)

    def _install(self, name: str) -> None:
        """Load model ``name`` with its own cache manager."""
        self._loading = name
        self._publish()
        try:
            loaded = self._load(name)  # warmed up: load_model's head-dims probe is a forward pass
            self._drafts = self._load_draft(loaded) if self._load_draft is not None else None
            self._caches = self._make_caches(loaded)
            self._batch = self._new_batch(loaded)
            self._loaded = loaded
        finally:
            self._loading = None
            self._publish()

    def _swap(self, name: str) -> None:
        """Unload the model (its caches are flushed to disk and stay there) and load ``name``.

        If ``name`` cannot load, the requests waiting for it fail and the previous model
        is loaded again.
        """
        assert self._loaded is not None and self._caches is not None
        previous = self._loaded.name
        log.info("swapping model %s for %s (%d requests waiting)", previous, name, len(self._queue))
        start = time.perf_counter()
        self._caches.close()
        self._loaded = self._caches = self._batch = None
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
        self._swaps += 1
        self._publish()
        log.info("model %s loaded in %.1f s", name, time.perf_counter() - start)

    # -- the loop ---------------------------------------------------------------------------

    def _idle(self) -> None:
        """Nothing to run: wait for work; caches past their hot TTL go warm meanwhile, and
        after a start the recently used conversations come back from disk, a step at a time."""
        assert self._caches is not None
        self._caches.expire_hot()
        prefetched = self._caches.prefetch()
        self._publish()
        if prefetched:
            return
        self._wake.wait(IDLE_CHECK_S)
        self._wake.clear()

    def _run_calls(self) -> None:
        assert self._caches is not None
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call is None:
                self._stopping = True
                continue
            if not call.result.set_running_or_notify_cancel():  # its caller gave up waiting
                continue
            try:
                result = call.fn(self._caches)
            except Exception as exc:  # handed to the caller
                self._publish()
                call.result.set_exception(exc)
            else:
                self._publish()
                call.result.set_result(result)

    def _admit(self) -> None:
        for job in self._queue.drop_cancelled():
            log.info("request %s: cancelled while queued", job.request.request_id)
            job.put(cancelled_in_queue(job))
        now = time.perf_counter()
        for place, job in self._queue.take_expired(self._max_queue_wait_s, now):
            retry_after = queue_retry_after(place, list(self._finishes), now, self._max_queue_wait_s)
            message = (f"the request waited {now - job.arrived:.0f} s in the queue without starting "
                       f"(max_queue_wait_s {self._max_queue_wait_s:g}); retry in about {retry_after} s")
            log.warning("request %s: %s", job.request.request_id, message)
            job.put(Failed(message, QueueTimeout(message, retry_after)))
        loaded = self._loaded
        assert loaded is not None

        def can_start(candidate: Job) -> bool:
            running = [s.job.request for s in (*self._prefilling, *self._decoding.values())]
            return self._admission.can_start(candidate.request, running, loaded)

        while (taken := self._queue.take(can_start, lambda j: self._model_of(j) != loaded.name)) is not None:
            if taken.cancelled:
                taken.put(cancelled_in_queue(taken))
                continue
            try:
                self._prefilling.append(self._start(taken))
            except Exception as exc:  # one bad request must not stop the others
                log.exception("request %s could not start", taken.request.request_id)
                taken.put(Failed(f"generation failed: {exc}"))

    def _model_of(self, job: Job) -> str:
        return job.request.model or self._default

    def _start(self, job: Job) -> Sequence:
        """A lease on the conversation's cache, and the generation that continues it."""
        loaded, caches, request = self._loaded, self._caches, job.request
        assert loaded is not None and caches is not None
        taken = time.perf_counter()
        lease = caches.lease(request.agent_id, request.conversation_id, request.prompt,
                             whole_blocks=request.whole_blocks)
        clock = TurnClock(arrived=job.arrived, taken=taken, leased=time.perf_counter(), staged_s=request.staged_s)
        sequence = Sequence.begin(job, lease, loaded, clock)
        job.put(Started(sequence.n_prompt, lease.n_reused, sequence.n_written, lease.report))
        return sequence

    def _new_batch(self, loaded: LoadedModel) -> DecodeBatch:
        """An empty batch for ``loaded``; its forward passes of several rows (sequences, or a
        draft's positions) split over both cores (``cores.py``)."""
        return DecodeBatch(loaded.model, self._speculative_tokens,
                           loaded.cores.use if loaded.cores is not None else None, self._drafts)

    def _step(self) -> None:
        assert self._loaded is not None and self._batch is not None
        cores = self._loaded.cores
        self._decode_step()
        if cores is not None and self._prefilling:
            cores.use(False)  # a prefill chunk's large matmuls and attention use OpenBLAS's threads
        self._prefill_step()

    def _decode_step(self) -> None:
        assert self._batch is not None
        if not len(self._batch):
            return
        done = []  # (uid, tokens it was handed after its end)
        start = time.perf_counter()
        stepped = self._batch.step()
        split = self._loaded is not None and self._loaded.cores is not None and self._loaded.cores.active
        self._counters = self._counters.after_decode(len(stepped), time.perf_counter() - start, split,
                                                     sum(len(tokens) for _, tokens in stepped))
        for uid, tokens in stepped:
            sequence = self._decoding[uid]
            n_top = sequence.job.request.sampling.logprobs
            logprobs = self._batch.logprobs.get(uid) if n_top is not None else None
            for i, token in enumerate(tokens):  # a verified draft ends where plain decoding would
                entry = None
                if logprobs is not None and n_top is not None and len(tokens) == 1 \
                        and token not in sequence.stop_ids:
                    entry = token_logprobs(logprobs, token, n_top, sequence.token_bytes)
                if sequence.accept(token, entry):
                    done.append((uid, len(tokens) - 1 - i))
                    break
        for uid, n_unused in done:
            sequence = self._decoding.pop(uid)
            sequence.n_drafted, sequence.n_accepted = self._batch.drafts(uid)
            self._counters = self._counters.after_drafts(sequence.n_drafted, sequence.n_accepted)
            self._finish(sequence, partial(self._batch.remove, uid, n_unused))

    def _prefill_step(self) -> None:
        for sequence in [s for s in self._prefilling if s.job.cancelled]:
            self._prefilling.remove(sequence)
            sequence.reason = "cancelled"
            kept = self._keep_prefilled(sequence)
            log.info("request %s: cancelled during prefill (%d of %d prompt tokens computed, %s)",
                     sequence.job.request.request_id, sequence.n_prefilled, len(sequence.prompt_ids),
                     "kept in its conversation's cache" if kept else "not kept")
            self._publish()
            sequence.put(sequence.finished(committed=False))
        if not self._prefilling:
            return
        sequence = self._prefilling[self._policy.pick(self._prefilling)]
        if sequence.n_pending > 0:
            # Longer prefills paused behind this one do not wait on its chunk's size: the
            # shortest goes first anyway, so a side request's prompt takes whole chunks.
            alone = not self._decoding and not len(self._queue)
            n = sequence.clip_chunk(self._policy.chunk(sequence, alone))
            loaded = self._loaded
            assert loaded is not None
            start = time.perf_counter()
            prefill(loaded.model, sequence.cache, sequence.prompt_ids[sequence.n_prefilled:sequence.n_prefilled + n])
            elapsed = time.perf_counter() - start
            sequence.seconds_per_token = elapsed / n
            sequence.n_prefilled += n
            sequence.job.progress = (sequence.lease.n_reused + sequence.n_prefilled, sequence.n_prompt)
            self._log_progress(sequence, n)
            sequence.after_prefill()
            self._counters = self._counters.after_prefill(n, elapsed)
            if sequence.n_pending > 0:
                self._checkpoint(sequence)
        if sequence.n_pending <= 0:
            self._prefilling.remove(sequence)
            if sequence.max_new > 0:
                self._begin_decoding(sequence)
            else:  # prefill only: the cache is the result
                sequence.reason = "max_tokens"
                self._finish(sequence, lambda: sequence.cache)

    def _keep_prefilled(self, sequence: Sequence) -> bool:
        """Commit what a cancelled prefill computed to its conversation's cache, as a finished
        turn's would be (its blocks in memory, then on disk), so that the same prompt sent again
        (a client's retry) resumes from there, as llama.cpp keeps a slot's work. True if kept."""
        record = sequence.prefilled_record()
        caches, request = self._caches, sequence.job.request
        if record is None or caches is None:
            return False
        try:
            caches.commit(sequence.lease, record, sequence.cache, persist=request.persist,
                          hot_ttl_s=request.hot_ttl_s)
        except Exception:  # only reuse is lost
            log.exception("request %s: keeping the prefilled cache failed", request.request_id)
            return False
        return True

    def _checkpoint(self, sequence: Sequence) -> None:
        """Every ``prefill_checkpoint_s`` of a long prefill, store what it has computed, in
        memory and on disk (``CacheManager.checkpoint``: the working cache is left as it is),
        once it holds a block more than the last time: a process killed mid-prefill (a SIGKILL,
        a power cut) keeps the blocks that reached disk, and the same prompt sent again after
        the restart resumes from there."""
        if self._prefill_checkpoint_s <= 0 or not sequence.job.request.persist:
            return
        now = time.perf_counter()
        since = sequence.checkpointed_at if sequence.checkpointed_at is not None else sequence.clock.leased
        reused = sequence.lease.n_reused
        blocks_now = (reused + sequence.n_prefilled) // BLOCK_TOKENS
        if now - since < self._prefill_checkpoint_s or blocks_now <= (reused + sequence.n_checkpointed) // BLOCK_TOKENS:
            return
        sequence.checkpointed_at = now
        record, caches = sequence.prefilled_record(), self._caches
        if record is None or caches is None:
            return
        try:
            caches.checkpoint(sequence.lease, record, sequence.cache)
        except Exception:  # only what a crash would keep is lost
            log.exception("request %s: storing the prefill's checkpoint failed", sequence.job.request.request_id)
            return
        sequence.n_checkpointed = sequence.n_prefilled
        log.info("request %s: prefill checkpoint, %d of %d prompt tokens stored", sequence.job.request.request_id,
                 record.n_tokens, sequence.n_prompt)

    def _log_progress(self, sequence: Sequence, n: int) -> None:
        """A long prompt's prefill logs a line at the chunk that crosses each quarter (a client
        may see nothing for minutes on a CPU); ``n``: the tokens the chunk just computed."""
        total = len(sequence.prompt_ids)
        if total < LONG_PREFILL_CHUNKS * self._policy.step_tokens:
            return
        if quarter_reached(sequence.n_prefilled - n, sequence.n_prefilled, total) is not None:
            rate = 1 / (sequence.seconds_per_token or 1e-9)
            log.info("request %s: prefill %d%% (%d of %d new tokens, %.0f tokens/s)", sequence.job.request.request_id,
                     100 * sequence.n_prefilled // total, sequence.n_prefilled, total, rate)

    def _begin_decoding(self, sequence: Sequence) -> None:
        assert self._batch is not None
        uid = next(self._uids)
        self._decoding[uid] = sequence
        sampling = sequence.job.request.sampling
        self._batch.add(uid, sequence.cache, sequence.prompt_ids[-1], sequence.context_tokens, sequence.sampler,
                        (*self._processors, *sequence.processors), speculate=sampling.may_draft,
                        distribution=sequence.distribution, key=sequence.job.request.conversation_id)

    def _finish(self, sequence: Sequence, take_cache: Callable[[], list[Any]]) -> None:
        """End the turn, then commit its cache (``take_cache`` hands it over).

        A reply ends first: its reader commits the turn's history, which is what must be
        durable, and the agent's next step need not wait for the cache's quantization. The
        cache is committed right after, on this thread, before any later job is admitted or
        call is run: a next turn, fork or export finds it. A prefill-only turn (an agent's
        creation) ends after its commit: its cache is its result. A failed commit loses reuse only.
        """
        caches, request = self._caches, sequence.job.request
        assert caches is not None
        if sequence.reason == "cancelled":
            log.info("request %s: cancelled after %d output tokens", request.request_id, len(sequence.output))
        sequence.flush_text()
        committed = sequence.committable
        reply_first = sequence.max_new > 0
        if reply_first:
            sequence.put(sequence.finished(committed))
        cache = take_cache()
        if committed:
            try:
                caches.commit(sequence.lease, sequence.record(), cache,
                              persist=request.persist, hot_ttl_s=request.hot_ttl_s)
            except Exception:  # the reply is still good; only reuse is lost
                log.exception("request %s: storing the cache failed", request.request_id)
        self._finishes.append(time.perf_counter())
        self._publish()
        if not reply_first:
            sequence.put(sequence.finished(committed))

    def _fail_all(self, message: str) -> None:
        """After a failed step: every running sequence fails (their caches are in doubt)."""
        for sequence in [*self._prefilling, *self._decoding.values()]:
            sequence.put(Failed(message))
        self._prefilling.clear()
        self._decoding.clear()
        assert self._loaded is not None
        self._batch = self._new_batch(self._loaded)
        self._publish()
