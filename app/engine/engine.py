"""Engine: inference behind the ``EngineSurface`` (``surface.py``) the API sees.

Everything MLX lives behind this class: it owns the engine thread (``runner.py``), renders
prompts with each model's tokenizer on the caller's thread, refuses what can never run
(``admission.py``), and answers status questions from the snapshot the engine thread last
published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.cache.hashing import scoped_fingerprint
from app.cache.manager import CacheManager
from app.cache.shared_tier import S3Tier
from app.cache.stager import Stager
from app.catalog.registry import Catalog
from app.engine import grammar
from app.engine.admission import Admission
from app.engine.backend import detect, warmup_chunks
from app.engine.channel import Job
from app.engine.draft_model import DRAFTS_SHARE, DraftModel, draft_bytes_per_token, load_draft_model
from app.engine.model import LoadedModel, ModelSpec, backend_name, load_model, load_spec
from app.engine.prompting import check_fits, render_chat, render_completion, render_conversation_start
from app.engine.runner import Runner
from app.engine.surface import EngineStatus, ModelInfo
from app.errors import EngineUnavailable, ModelLoading, TooLargeForMemory
from app.types import ChatMessage, ForkPoint, GenerationRequest, Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Where and how the engine keeps KV caches."""

    blocks_dir: Path
    sessions: sessionmaker[Session]
    budget_bytes: int
    enabled: bool = True
    max_conversations: int = 8
    kv_format_for: Callable[[str], str] = lambda _model: "auto"  # model name -> stored format's name or "auto"
    scope: str = ""  # in a pool without a shared tier: this server's id (``hashing.scoped_fingerprint``)
    tier: S3Tier | None = None  # a pool's shared block tier
    owner: str | None = None  # with a tier: this server's id, the owner it claims agents as

    def manager_for(self, loaded: LoadedModel) -> CacheManager:
        return CacheManager(fingerprint=scoped_fingerprint(loaded.fingerprint, self.scope), n_layers=loaded.n_layers,
                            dtype=loaded.compute_dtype, blocks_dir=self.blocks_dir, sessions=self.sessions,
                            budget_bytes=self.budget_bytes, enabled=self.enabled,
                            max_conversations=self.max_conversations, kv_format=loaded.kv_format, tier=self.tier,
                            owner=self.owner, layout=loaded.cache_layout)


class Engine:
    """Owns the engine thread. Start it, then render prompts and submit them. Implements
    ``surface.EngineSurface``; the loaded model and its cache manager are the engine thread's
    alone (tests reach them through ``tests/support/engines.py``)."""

    def __init__(self, catalog: Catalog, cache: CacheConfig, *, dtype: str = "auto",
                 max_queue: int = 16, prefill_step_size: int = 256, repetition_penalty: float = 1.0,
                 max_batch: int = 8, split_cores: bool = True, speculative_tokens: int = 8,
                 draft_model: Path | None = None, calibrate_at_load: bool = True,
                 max_queue_wait_s: float = 300, prefill_checkpoint_s: float = 0) -> None:
        """The default model loads when the engine starts (an embedded model is imported
        first, while the server already answers); a request for another model of the
        ``catalog`` swaps it in. ``split_cores``: see ``cores.py``. ``speculative_tokens``: the
        longest prompt-lookup draft a greedy request proposes a step (0: no speculation;
        ``speculation.py``). ``draft_model``: the directory of a smaller model sharing the
        served models' vocabulary, which drafts instead (``draft_model.py``). ``calibrate_at_load``
        False: a model whose KV format is not calibrated yet serves the lossless one at once
        (``load_model``'s ``calibrate_pending``). ``max_queue_wait_s``: a request that waits
        that long in the queue without starting is refused (QueueTimeout, a 429).
        ``prefill_checkpoint_s``: a long prefill stores what it computed that often (0: never
        before it ends; ``Runner._checkpoint``)."""
        self._catalog = catalog
        self._dtype = dtype
        self._scope = cache.scope
        self._cache_enabled = cache.enabled
        self._kv_format_for = cache.kv_format_for
        self._specs: dict[str, ModelSpec] = {}
        self._specs_lock = threading.Lock()
        drafts_bytes = int(cache.budget_bytes * DRAFTS_SHARE) if draft_model is not None else 0
        cache = replace(cache, budget_bytes=cache.budget_bytes - drafts_bytes)  # the draft caches' share
        self._admission = Admission(cache.budget_bytes, max_batch,
                                    draft_bytes_per_token(draft_model, dtype) if draft_model is not None else 0)
        self._stager = Stager(cache.blocks_dir, cache.sessions, cache.tier)
        warmup = warmup_chunks(detect(), prefill_step_size)
        self._runner = Runner(lambda name: load_model(name, catalog.install(name), dtype,
                                                      cache.kv_format_for(name), split_cores, warmup=warmup,
                                                      calibrate_pending=calibrate_at_load),
                              cache.manager_for, default=catalog.default,
                              max_queue=max_queue, prefill_step_size=prefill_step_size,
                              admission=self._admission, repetition_penalty=repetition_penalty,
                              speculative_tokens=speculative_tokens, max_queue_wait_s=max_queue_wait_s,
                              prefill_checkpoint_s=prefill_checkpoint_s,
                              load_draft=None if draft_model is None else
                              lambda loaded: DraftModel(load_draft_model(draft_model, loaded, dtype), drafts_bytes))
        self.started_at = time.time()

    def start(self, timeout_s: float | None = None) -> None:
        """Start the thread and wait for the model to load.

        Raises:
            EngineUnavailable: loading failed (the cause is chained).
        """
        self.start_loading()
        self.wait_loaded(timeout_s)

    def start_loading(self) -> None:
        """Start the thread; the model loads in the background (``status().loading``)."""
        self._runner.start()

    def wait_loaded(self, timeout_s: float | None = None) -> None:
        """Wait until loading finished.

        Raises:
            EngineUnavailable: loading failed (the cause is chained).
        """
        self._runner.ready.wait(timeout_s)
        if self._runner.load_error is not None:
            raise EngineUnavailable(f"model failed to load: {self._runner.load_error}") from self._runner.load_error

    def stop(self, timeout_s: float = 60) -> None:
        """Finish queued work, write pending cache files, stop the thread."""
        self._runner.stop()
        self._runner.join(timeout_s)

    def cancel_all(self) -> None:
        """Cancel every queued and running generation (Ctrl-C); returns at once. Each ends with
        a cancelled ``Finished``, as when its client leaves; ``stop`` then has nothing to finish."""
        self._runner.cancel_all()

    @property
    def catalog(self) -> Catalog:
        """The models a request may name."""
        return self._catalog

    @property
    def model(self) -> ModelInfo:
        """The loaded model, or the one being swapped in. Raises EngineUnavailable at start."""
        published = self._runner.snapshot
        loaded = published.loaded
        return self._info(loaded if loaded is not None else self._spec(published.loading or self._catalog.default))

    def resolve(self, requested: str | None) -> ModelInfo:
        """The model a request's ``model`` names (see ``Catalog.resolve``).

        Raises:
            NotFound; ModelLoading (an EngineUnavailable): the default model is still loading.
        """
        return self._info(self._spec(self._catalog.resolve(requested)))

    def model_names(self) -> Mapping[str, str]:
        """Model name by fingerprint, of every model this engine has read since it started."""
        with self._specs_lock:
            specs = list(self._specs.values())
        loaded = self._runner.snapshot.loaded
        if loaded is not None:
            specs.append(loaded)
        return {scoped_fingerprint(spec.fingerprint, self._scope): spec.name for spec in specs}

    def _spec(self, name: str | None) -> ModelSpec:
        """Tokenizer side of model ``name`` (default: the default model), from any thread."""
        name = name or self._catalog.default
        loaded = self._runner.snapshot.loaded
        if loaded is not None and loaded.name == name:
            return loaded
        if name == self._catalog.default and not self._runner.ready.is_set():
            raise ModelLoading("the model is still loading")  # its first import may be under way
        with self._specs_lock:
            if name not in self._specs:
                self._specs[name] = load_spec(name, self._catalog.install(name), self._dtype,
                                              self._kv_format_for(name))
            return self._specs[name]

    def render(self, messages: Sequence[ChatMessage], reply_prefix: str = "", model: str | None = None,
               tools: Sequence[dict[str, Any]] = (), prefill: str = "") -> Prompt:
        """The prompt ``model`` (default: the default model) would see for ``messages``
        (``tools``: definitions for a template that writes them, see ``ModelInfo.tool_syntax``)."""
        spec = self._spec(model)
        return render_chat(spec.tokenizer, messages, reply_prefix, max_tokens=spec.context_length - 1,
                           max_token_chars=spec.token_bytes.longest, tools=tools, prefill=prefill)

    def render_completion(self, prompt: str, suffix: str | None = None, model: str | None = None) -> Prompt:
        """The prompt ``model`` (default: the default model) reads for a raw ``prompt``
        (``suffix``: fill-in-the-middle). Raises InvalidRequest, ContextTooLong."""
        spec = self._spec(model)
        return render_completion(spec.tokenizer, prompt, suffix, max_tokens=spec.context_length - 1,
                                 max_token_chars=spec.token_bytes.longest)

    def render_start(self, system: str, model: str | None = None) -> Prompt | None:
        """What every conversation under ``system`` starts with; None when the
        template allows no cut (see ``render_conversation_start``)."""
        return render_conversation_start(self._spec(model).tokenizer, system)

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a generation on ``request.model`` (default: the default model); iterate
        ``job.events()`` for its output.

        Raises:
            ContextTooLong, EngineUnavailable; InvalidRequest: its output constraint cannot hold on the model;
            TooLargeForMemory: its working cache alone would exceed the memory budget (a 400);
            Overloaded: ``max_queue`` requests already wait for a place in the batch.
        """
        arrived = request.arrived_at if request.arrived_at is not None else time.perf_counter()
        spec = self._spec(request.model)
        request = replace(request, model=spec.name, arrived_at=arrived)
        self.check_fits(request.prompt, spec.name)
        grammar.check(request.sampling.constraint, spec)  # a format this model cannot hold: a 400, not a failed turn
        refusal = self._admission.refusal(request, spec)
        if refusal is not None:
            raise TooLargeForMemory(refusal)
        if request.conversation_id is not None and self._cache_enabled:
            start = time.perf_counter()  # a restore's network time, on this thread (the model it names)
            self._stager.stage(scoped_fingerprint(spec.fingerprint, self._scope), request.conversation_id)
            request = replace(request, staged_s=request.staged_s + time.perf_counter() - start)
        return self._runner.submit(request)

    def check_fits(self, prompt: Prompt, model: str | None = None) -> None:
        """Raises ContextTooLong if ``prompt`` leaves no room for an output token."""
        check_fits(prompt, self._spec(model).context_length)

    def status(self) -> EngineStatus:
        published = self._runner.snapshot
        loaded = published.loaded
        return EngineStatus(
            healthy=self._runner.is_alive() and self._runner.ready.is_set() and self._runner.load_error is None,
            loading=not self._runner.ready.is_set() or published.loading is not None,
            model=loaded.name if loaded else published.loading,
            backend=backend_name(),
            dtype=loaded.dtype if loaded else None,
            context_length=loaded.context_length if loaded else None,
            queue_depth=self._runner.queue_depth,
            n_active=published.n_active,
            cache=published.cache,
            counters=published.counters,
            swaps=published.swaps,
            split_cores=loaded is not None and loaded.cores is not None,
            kv=loaded.kv if loaded else None,
            prefills=published.prefills,
        )

    def hot_tokens(self, agent_id: str) -> Mapping[str, int]:
        """Cached tokens of the agent's conversations held in memory, by conversation id."""
        return self._runner.snapshot.hot.get(agent_id, {})

    def hot_conversations(self) -> Mapping[str, int]:
        """Cached tokens of every conversation held in memory, by conversation id."""
        return {c: n for conversations in self._runner.snapshot.hot.values() for c, n in conversations.items()}

    def forget_agent(self, agent_id: str) -> None:
        """Delete the agent's caches: memory, files and index rows. The engine thread drops them
        and queues the deletions; this thread waits for the disk (up to 60 s), not the engine's."""
        deleted = self._runner.call(lambda caches: caches.forget_agent(agent_id))
        if not deleted(60):
            log.warning("agent %s: its cache files were not all deleted within 60 s; they go when the disk "
                        "catches up", agent_id)

    def fork_cache(self, source: str, agent_id: str, conversation_id: str, point: ForkPoint | None = None,
                   timeout_s: float = 60) -> bool:
        """Copy the ``source`` conversation's stored cache to a forked agent's conversation, up to
        ``point`` (None: all of it; its full blocks shared by reference) and wait for it. Queued
        on the engine thread, so the source's last finished turn is written first."""
        done = self._runner.call(lambda caches: caches.fork(source, agent_id, conversation_id, point))
        return done.wait(timeout_s)

    def _info(self, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(spec.name, spec.path, scoped_fingerprint(spec.fingerprint, self._scope), spec.context_length,
                         spec.tool_syntax)
