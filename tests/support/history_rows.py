"""The agent and conversation rows the server's history writer (``app/store/history.py``,
through ``AgentService.accept``) makes before a turn runs, for tests that drive the cache
layer or the engine directly: the cache persister writes no history rows, and a cache row
references its conversation."""

from __future__ import annotations

from typing import Iterable

from sqlalchemy.orm import Session, sessionmaker

from app.clock import utcnow
from app.store.history import ensure_conversation, touch_agent


def add_conversations(sessions: sessionmaker[Session], agent: str, conversations: Iterable[str] = ()) -> None:
    """Create ``agent`` (origin ``direct``) and its ``conversations`` if missing."""
    with sessions.begin() as session:
        touch_agent(session, agent, "direct", utcnow())
        for conversation in conversations:
            ensure_conversation(session, conversation, agent, "direct", utcnow())
