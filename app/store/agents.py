"""Agent rows and their history, for the direct agent API. Functions take a Session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.store.models import Agent, Cache, Message


@dataclass(frozen=True, slots=True)
class AgentView:
    id: str
    origin: str
    created_at: datetime
    last_access_at: datetime
    ttl_seconds: int | None
    hot_ttl_seconds: int | None
    status: str
    metadata: dict[str, Any]
    n_messages: int
    caches: tuple[tuple[str, int, str], ...]  # (model fingerprint, cached tokens, tier)


def create(session: Session, agent_id: str, metadata: dict[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    """False if the id is taken."""
    if session.get(Agent, agent_id) is not None:
        return False
    session.add(Agent(id=agent_id, origin="direct", created_at=now, last_access_at=now, ttl_seconds=ttl_seconds,
                      status="active", metadata_json=metadata))
    return True


def view(session: Session, agent_id: str) -> AgentView | None:
    agent = session.get(Agent, agent_id)
    if agent is None:
        return None
    n_messages = session.scalar(select(func.count()).where(Message.agent_id == agent_id)) or 0
    caches = tuple(session.execute(select(Cache.model_fingerprint, Cache.n_tokens, Cache.tier)
                                   .where(Cache.agent_id == agent_id)).tuples())
    return AgentView(agent.id, agent.origin, agent.created_at, agent.last_access_at, agent.ttl_seconds,
                     agent.hot_ttl_seconds, agent.status, dict(agent.metadata_json or {}), n_messages, caches)


def list_ids(session: Session, limit: int, offset: int) -> list[str]:
    return list(session.scalars(select(Agent.id).order_by(Agent.last_access_at.desc()).limit(limit).offset(offset)))


def history(session: Session, agent_id: str) -> list[Message]:
    return list(session.scalars(select(Message).where(Message.agent_id == agent_id).order_by(Message.position)))


def remove(session: Session, agent_id: str) -> None:
    """Delete the agent and its messages (requests keep their rows, unlinked)."""
    session.execute(delete(Message).where(Message.agent_id == agent_id))
    session.execute(delete(Agent).where(Agent.id == agent_id))
