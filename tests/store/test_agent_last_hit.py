"""An agent's status names each conversation's last read from cache: its latest request that
reused cached tokens, on SQLite and PostgreSQL (no model)."""

from __future__ import annotations

from datetime import timedelta

from app.store import agents as agents_store
from app.store.db import make_engine, make_session_factory, upgrade
from app.clock import utcnow
from app.store.history import ensure_conversation
from app.store.models import Request


def test_the_latest_request_that_read_from_cache_per_conversation(store_url: str) -> None:
    upgrade(store_url)
    sessions = make_session_factory(make_engine(store_url))
    start = utcnow()
    # (conversation, minutes after start, cached tokens, prompt tokens): a hit, a later miss,
    # the latest hit; another conversation that never hit; another agent's later hit.
    requests = [("conv_a", 1, 10, 50), ("conv_a", 3, 30, 60), ("conv_a", 5, 0, 70), ("conv_b", 2, 0, 40),
                ("conv_other", 9, 99, 100)]
    with sessions.begin() as session:
        for conversation, agent in (("conv_a", "hits"), ("conv_b", "hits"), ("conv_other", "other")):
            ensure_conversation(session, conversation, agent, "direct", start)
        session.flush()
        for n, (conversation, minutes, cached, prompt) in enumerate(requests):
            session.add(Request(id=f"req_{n}", agent_id="other" if conversation == "conv_other" else "hits",
                                conversation_id=conversation, protocol="direct", status="ok",
                                n_input_tokens=prompt, n_cached_tokens=cached,
                                created_at=start + timedelta(minutes=minutes)))
    with sessions() as session:
        view = agents_store.view(session, "hits")
    assert view is not None
    hits = {c.id: c.last_hit for c in view.conversations}
    assert hits["conv_b"] is None
    hit = hits["conv_a"]
    assert hit is not None and (hit.cached_tokens, hit.input_tokens) == (30, 60)
    assert hit.at == start + timedelta(minutes=3)
