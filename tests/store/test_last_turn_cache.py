"""The operator page's "last turn's cache": each conversation's latest turn that ran, with
where its cache came from (``requests.cache_source``), on SQLite and PostgreSQL (no model)."""

from __future__ import annotations

from datetime import timedelta

from app.store import overview
from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow
from app.store.history import ensure_conversation
from app.store.models import Request


def test_each_conversation_shows_its_latest_turns_cache_source(store_url: str) -> None:
    upgrade(store_url)
    sessions = make_session_factory(make_engine(store_url))
    start = utcnow()
    # (conversation, minutes after start, source, reason, cached tokens): a first turn, a later
    # one read from disk, then one that never ran (rejected: no reason); a row from before 0011.
    requests = [("conv_a", 1, "none", "miss", 0), ("conv_a", 3, "disk", "extend", 300), ("conv_a", 5, None, None, 0),
                ("conv_b", 2, None, "shared", 256)]
    with sessions.begin() as session:
        for conversation in ("conv_a", "conv_b", "conv_c"):
            ensure_conversation(session, conversation, "agent", "direct", start)
        session.flush()
        for n, (conversation, minutes, source, reason, cached) in enumerate(requests):
            session.add(Request(id=f"req_{n}", agent_id="agent", conversation_id=conversation, protocol="direct",
                                status="ok" if reason else "rejected", reuse_reason=reason, cache_source=source,
                                n_cached_tokens=cached, created_at=start + timedelta(minutes=minutes)))
    with sessions() as session:
        [agent] = overview.agents(session)
    last = {c.id: c.last_turn for c in agent.conversations}
    assert last == {"conv_a": overview.LastTurnCache("disk", "extend", 300),
                    "conv_b": overview.LastTurnCache(None, "shared", 256), "conv_c": None}
