"""A fake engine behind the Engine's surface (``app.engine.surface.EngineSurface``), with
words for tokens, and the API on it with a real store: the API layer's tests run without a
model or MLX (tests/unit/test_api_tier_without_mlx.py blocks MLX and runs them). The real
engine behind the same surface is tested end to end in tests/e2e;
tests/api/test_app_with_a_fake_engine.py checks both have the surface the API sees."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import falcon.testing

from app.agents.service import AgentService
from app.api.routes import Deps
from app.cache.formats import KV_FORMATS
from app.catalog.registry import Catalog
from app.engine.kv_choice import Calibration, KVChoice, Measured
from app.engine.surface import EngineCounters, EngineStatus, ModelInfo
from app.engine.timing import PrefillProgress
from app.errors import ContextTooLong, InvalidRequest
from app.main import create_app
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import (CacheStats, ChatMessage, Finished, ForkPoint, GenerationRequest, Heartbeat, Prompt, ReuseReport,
                       Started, TextDelta, TokenLogprob)

CONTEXT = 64


@dataclass
class FakeJob:
    request: GenerationRequest
    cancelled: bool = False
    parts: tuple[float, float, float] = (0.002, 0.003, 0.005)  # queue, restore, prefill (seconds)
    reuse: ReuseReport | None = None  # its lease's report (provenance)
    queued: bool = False  # it waits in the queue past a heartbeat before its lease
    drafts: tuple[int, int] = (0, 0)  # draft tokens proposed, kept
    expire: Exception | None = None  # raised from the queue (a QueueTimeout), after its heartbeat if queued
    stop_reason: str = "end_turn"  # how it ends ("cancelled": the server stopped it part way)

    def events(self, client_gone=None, heartbeat_s=None) -> Iterator:  # type: ignore[no-untyped-def]
        n = self.request.prompt.n_tokens
        if self.queued:
            yield Heartbeat()
        if self.expire is not None:
            raise self.expire
        yield Started(n, 0, n, self.reuse)
        n_top = self.request.sampling.logprobs
        logprobs = () if n_top is None else fake_logprobs(("Hello", " there", "."), n_top)
        yield TextDelta("Hello there.", logprobs)
        queue_s, restore_s, prefill_s = self.parts
        yield Finished(self.stop_reason, None, n, 0, n, 3, sum(self.parts), sum(self.parts) + 0.01, reuse=self.reuse,
                       queue_s=queue_s, restore_s=restore_s, prefill_s=prefill_s, logprobs=logprobs,
                       n_draft_tokens=self.drafts[0], n_draft_accepted=self.drafts[1])

    def cancel(self) -> None:
        self.cancelled = True


def fake_logprobs(tokens: tuple[str, ...], n_top: int) -> tuple[TokenLogprob, ...]:
    """Each token at logprob -0.5, its alternatives (``n_top`` of them) below it."""
    def entry(token: str, logprob: float) -> TokenLogprob:
        return TokenLogprob(token, tuple(token.encode()), logprob)
    return tuple(TokenLogprob(t, tuple(t.encode()), -0.5, tuple(entry(t if i == 0 else f"{t}{i}", -0.5 - i)
                                                                for i in range(n_top))) for t in tokens)


class FakeEngine:
    """The Engine's surface, with words for tokens; it imports no MLX, nor does anything the
    API reaches through it (the surface's values included: tests/unit/test_api_tier_without_mlx.py)."""

    def __init__(self, path: Path) -> None:
        self.model = ModelInfo("fake", path, "fp-fake", CONTEXT)
        self.catalog = Catalog.single("fake", path)
        self.started_at = time.time()
        self.refuse: Exception | None = None
        self.loading = False
        self.submitted: list[GenerationRequest] = []
        self.submitted_at: list[float] = []  # time.perf_counter() as each was submitted
        self.parts = (0.002, 0.003, 0.005)  # the queue, restore and prefill seconds its jobs report
        self.hot: dict[str, dict[str, int]] = {}  # agent -> conversation -> tokens in memory
        self.prefills: tuple[PrefillProgress, ...] = ()
        self.reuse: ReuseReport | None = None  # what its jobs' leases report
        self.queued = False  # its jobs wait in the queue past a heartbeat
        self.drafts = (0, 0)  # draft tokens its jobs report proposed and kept
        self.expire: Exception | None = None  # what its jobs raise from the queue (a QueueTimeout)
        self.stop_reason = "end_turn"  # how its jobs end

    def resolve(self, requested: str | None) -> ModelInfo:
        assert self.catalog.resolve(requested) == "fake"
        return self.model

    def render(self, messages: tuple[ChatMessage, ...], reply_prefix: str = "", model: str | None = None,
               tools: tuple[dict, ...] = (), prefill: str = "") -> Prompt:
        text = "".join(f"<{m.role}>{m.content}" for m in messages) + "<assistant>" + prefill + reply_prefix
        words = text.split()
        return Prompt(text, tuple(range(len(words))), ())

    def render_completion(self, prompt: str, suffix: str | None = None, model: str | None = None) -> Prompt:
        if suffix is not None:
            raise InvalidRequest("suffix: the served model has no fill-in-the-middle tokens", "suffix")
        return Prompt(prompt, tuple(range(len(prompt.split()))), ())

    def render_start(self, system: str, model: str | None = None) -> Prompt:
        return self.render((ChatMessage("system", system),))

    def check_fits(self, prompt: Prompt, model: str | None = None) -> None:
        if prompt.n_tokens > CONTEXT - 1:
            raise ContextTooLong(prompt.n_tokens, CONTEXT - 1)

    def submit(self, request: GenerationRequest) -> FakeJob:
        self.check_fits(request.prompt)
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(request)
        self.submitted_at.append(time.perf_counter())
        return FakeJob(request, parts=self.parts, reuse=self.reuse, queued=self.queued, drafts=self.drafts,
                       expire=self.expire, stop_reason=self.stop_reason)

    def model_names(self) -> dict[str, str]:
        return {self.model.fingerprint: self.model.name}

    def hot_tokens(self, agent_id: str) -> dict[str, int]:
        return self.hot.get(agent_id, {})

    def hot_conversations(self) -> dict[str, int]:
        return {c: n for conversations in self.hot.values() for c, n in conversations.items()}

    def forget_agent(self, agent_id: str) -> None:
        pass

    def fork_cache(self, source: str, agent_id: str, conversation_id: str, point: ForkPoint | None = None,
                   timeout_s: float = 60) -> bool:
        if self.refuse is not None:
            raise self.refuse
        return True  # no cache to copy

    def status(self) -> EngineStatus:
        calibration = Calibration("key", "k6v4", {"k6v4": Measured(0.986, 0.0033, 0.0011, 0.34375)}, 36.5)
        kv = None if self.loading else KVChoice(KV_FORMATS["k6v4"], "calibration", calibration)
        return EngineStatus(healthy=not self.loading, loading=self.loading, model="fake", backend="none",
                            dtype="float32", context_length=CONTEXT, queue_depth=0, n_active=0,
                            cache=CacheStats(True, 0, 2**20, 0, 0, len(self.hot), len(self.hot_conversations()), 0),
                            counters=EngineCounters(), swaps=0, split_cores=False, kv=kv, prefills=self.prefills)


def make_app(tmp_path: Path) -> tuple[falcon.testing.TestClient, FakeEngine, Path]:
    """The app on a fake engine and a fresh store at ``tmp_path``: (its client, the engine, the database)."""
    db = tmp_path / "semantic.db"
    upgrade(f"sqlite:///{db}")
    sessions = make_session_factory(make_engine(f"sqlite:///{db}"))
    engine = FakeEngine(tmp_path)
    settings = Settings(home=tmp_path, allowed_hosts="falconframework.org")  # the TestClient's Host
    return falcon.testing.TestClient(create_app(Deps(settings, engine, AgentService(sessions), sessions))), engine, db
