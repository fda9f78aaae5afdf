"""The one thread that owns the model: it loads it, then runs queued generations.

HTTP threads never touch MLX. They put a job on the queue and read events from
the job's own queue; if this thread dies, readers notice (``Job.events``
raises) instead of hanging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from app.engine.model import LoadedModel
from app.engine.stopping import StopMatcher
from app.errors import EngineUnavailable, Overloaded
from app.types import Finished, GenerationEvent, GenerationRequest, Started, StopReason, TextDelta

log = logging.getLogger(__name__)

POLL_S = 0.5


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

    def events(self) -> Iterator[GenerationEvent]:
        """Events as the engine produces them, ending with ``Finished``.

        Raises:
            EngineUnavailable: the generation failed or the engine thread died.
        """
        while True:
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


class Runner(threading.Thread):
    """Loads the model, then generates for one job at a time, in queue order."""

    def __init__(self, load: Callable[[], LoadedModel], *, max_queue: int, prefill_step_size: int) -> None:
        super().__init__(name="semantic-engine", daemon=True)
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._prefill_step_size = prefill_step_size
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

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        try:
            self.loaded = self._load()
            self._warm_up(self.loaded)
        except BaseException as exc:  # reported to the starter through load_error
            self.load_error = exc
            return
        finally:
            self.ready.set()
        while (job := self._jobs.get()) is not None:
            self.n_active = 1
            try:
                self._generate(job)
            except Exception as exc:  # one failed generation must not kill the engine
                log.exception("generation %s failed", job.request.request_id)
                job.put(Failed(f"generation failed: {exc}"))
            finally:
                self.n_active = 0

    @staticmethod
    def _warm_up(loaded: LoadedModel) -> None:
        """One tiny forward pass, so the first request does not pay for kernel setup."""
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array([[0, 1, 2, 3]]), cache=cache))

    def _prompt_cache(self, job: Job) -> tuple[list, int]:
        """The KV cache to generate on and how many prompt tokens it already holds.

        NOTE: this is the seam where per-agent cache reuse plugs in; for now
        every prompt is prefilled from an empty cache.
        """
        assert self.loaded is not None
        return make_prompt_cache(self.loaded.model), 0

    def _generate(self, job: Job) -> None:
        loaded = self.loaded
        assert loaded is not None
        request = job.request
        started = time.perf_counter()
        cache, n_cached = self._prompt_cache(job)
        prompt = request.prompt.token_ids[n_cached:]
        job.put(Started(request.prompt.n_tokens, n_cached))
        sampling = request.sampling
        max_new = min(sampling.max_tokens, loaded.context_length - request.prompt.n_tokens)
        sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        detokenizer = loaded.tokenizer.detokenizer
        detokenizer.reset()
        stops = StopMatcher(sampling.stop_sequences)
        output: list[int] = []
        ttft = 0.0
        reason: StopReason = "max_tokens"
        stop_sequence: str | None = None
        steps = generate_step(mx.array(prompt), loaded.model, max_tokens=max_new, sampler=sampler,
                              prompt_cache=cache, prefill_step_size=self._prefill_step_size)
        for token, _ in steps:
            token = int(token)
            if not output:
                ttft = time.perf_counter() - started
            output.append(token)
            if job.cancelled:
                reason = "cancelled"
                break
            if token in loaded.stop_token_ids:
                reason = "end_turn"
                break
            detokenizer.add_token(token)
            check = stops.feed(detokenizer.last_segment)
            if check.emit:
                job.put(TextDelta(check.emit))
            if check.stop_sequence is not None:
                reason, stop_sequence = "stop_sequence", check.stop_sequence
                break
        if reason in ("end_turn", "max_tokens"):
            detokenizer.finalize()
            check = stops.feed(detokenizer.last_segment)
            if check.stop_sequence is not None:
                reason, stop_sequence = "stop_sequence", check.stop_sequence
            tail = check.emit if check.stop_sequence else check.emit + stops.flush()
            if tail:
                job.put(TextDelta(tail))
        job.put(Finished(
            stop_reason=reason, stop_sequence=stop_sequence,
            n_prompt_tokens=request.prompt.n_tokens, n_cached_tokens=n_cached,
            n_output_tokens=len(output), ttft_s=ttft, total_s=time.perf_counter() - started,
            output_token_ids=tuple(output),
        ))
