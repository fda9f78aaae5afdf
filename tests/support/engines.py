"""Real engines on a temporary home, and one turn through them (integration tests, benchmarks)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from sqlalchemy.orm import Session, sessionmaker

from app.cache.manager import CacheManager
from app.catalog.registry import Catalog
from app.engine.engine import CacheConfig, Engine
from app.engine.model import LoadedModel
from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow
from app.store.history import ensure_conversation, touch_agent
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams, TextDelta


def make_engine_at(home: Path, model_dir: Path, agents: Iterable[str], enabled: bool = True, budget: int = 1 << 30,
                   catalog: Catalog | None = None, kv_format: str = "auto", name: str = "smollm2") -> Engine:
    """A started engine serving ``model_dir`` whose store at ``home`` knows ``agents``;
    ``kv_format`` is the stored format's name or "auto"; ``enabled`` False turns reuse off."""
    home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    for agent in agents:
        _accept(sessions, agent)
    engine = Engine(catalog or Catalog.single(name, model_dir),
                    CacheConfig(home / "blocks", sessions, budget, enabled, kv_format_for=lambda _model: kv_format))
    engine.start()
    return engine


def _accept(sessions: sessionmaker[Session], agent: str) -> None:
    """The agent and its conversation (``conv``), as the server's history writer makes them
    before a turn runs (``AgentService.accept``): the cache persister writes no history rows.
    (tests/support/history_rows.py does the same for tests of the cache layer; this module
    is also imported as a script's neighbour, where ``support`` is not a package.)"""
    with sessions.begin() as session:
        touch_agent(session, agent, "direct", utcnow())
        ensure_conversation(session, f"{agent}-conversation", agent, "direct", utcnow())


def cache_manager(engine: Engine) -> CacheManager:
    """The engine thread's cache manager, reached from a test (the engine keeps it private:
    only its thread may use it while generations run; a test uses it while none does)."""
    caches = engine._runner._caches
    assert caches is not None, "the engine is not running"
    return caches


def loaded_model(engine: Engine) -> LoadedModel:
    """The engine thread's loaded model (weights, cache layout, fingerprint), for a test."""
    loaded = engine._runner._loaded
    assert loaded is not None, "no model is loaded"
    return loaded


def conv(agent: str | None) -> str | None:
    """Each agent in these tests holds one conversation."""
    return f"{agent}-conversation" if agent else None


def turn(engine: Engine, agent: str | None, messages: list[ChatMessage], sampling: SamplingParams,
         model: str | None = None) -> tuple[str, Finished]:
    """One generation to its end (and its cache committed): the reply's text and the Finished event.
    The agent and its conversation exist first, as the API makes them (``AgentService.accept``)."""
    caches = engine._runner._caches
    if agent is not None and caches is not None and caches.enabled:
        _accept(caches._index.sessions, agent)
    job = engine.submit(GenerationRequest(f"req-{agent}", engine.render(messages, model=model), sampling, agent,
                                          conv(agent), model=model))
    events = list(job.events())
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert wait_idle(engine)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), finished


def wait_idle(engine: Engine, timeout_s: float = 60) -> bool:
    """Wait until the engine runs and queues no generation, and every finished one's cache is
    committed (a reply ends first; the engine publishes its status after the commit).
    Polls the status the engine thread publishes."""
    deadline = time.monotonic() + timeout_s
    while (status := engine.status()).n_active or status.queue_depth:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def flush_caches(engine: Engine, timeout_s: float = 60) -> bool:
    """Wait until the caches of finished turns are committed and on disk."""
    return wait_idle(engine, timeout_s) and cache_manager(engine).flush(timeout_s)
