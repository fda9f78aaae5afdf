"""The cache persister writes cache rows only: the agent and conversation rows are the history
writer's (``app/store/history.py``, before a turn runs). A turn whose agent was deleted while
it ran leaves no cache, and does not bring the agent back (before: the persister made the agent
and the conversation again, an empty agent recognised by content). Real files, real SQLite and
PostgreSQL stores."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import func, select

from app.cache.files import CacheFiles
from app.cache.persist import Copy, Persister, Snapshot
from app.cache.records import CacheRecord, ConversationCache
from app.clock import utcnow
from app.store import agents as agents_store
from app.store.db import make_engine, make_session_factory, upgrade
from app.store.history import ensure_conversation
from app.store.models import Agent, Cache, Conversation


def snapshot(agent: str, conversation: str) -> Snapshot:
    record = CacheRecord((1, 2, 3), "abc", (1, 2, 3))
    return Snapshot(ConversationCache(agent, conversation, record, (), None), {})


def test_a_cache_is_stored_for_the_history_writers_conversation_only(tmp_path: Path, store_url: str) -> None:
    upgrade(store_url)
    sessions = make_session_factory(make_engine(store_url))
    with sessions.begin() as session:
        ensure_conversation(session, "kept", "alive", "direct", utcnow())
        ensure_conversation(session, "gone", "deleted", "direct", utcnow())
    persister = Persister(CacheFiles(tmp_path / "blocks", "f" * 64), sessions)
    persister._write(snapshot("alive", "kept"))
    with sessions.begin() as session:
        agents_store.remove(session, "deleted")  # deleted while its turn ran
    persister._write(snapshot("deleted", "gone"))  # that turn's cache
    persister._copy(Copy("kept", "deleted", "copy"))  # a fork whose conversation does not exist
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Agent).where(Agent.id == "deleted")) == 0
        assert list(session.scalars(select(Conversation.id))) == ["kept"]
        assert list(session.scalars(select(Cache.conversation_id))) == ["kept"]
        named = {Path(path) for path in session.scalars(select(Cache.record_path))}
    assert set((tmp_path / "blocks").rglob("*.safetensors")) == named  # the refused turn's record file went too
