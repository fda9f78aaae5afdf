"""Agents, requests and message history: the writes every protocol makes.

Each function takes a Session and commits nothing; callers keep transactions
short (one ``with session.begin()`` per step).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.store.models import Agent, Message, Request
from app.types import Finished


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def touch_agent(session: Session, agent_id: str, origin: str, now: datetime, *,
                ttl_seconds: int | None = None, hot_ttl_seconds: int | None = None) -> Agent:
    """Get the agent, creating it on first sight; record the access and any TTL the request sets."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        agent = Agent(id=agent_id, origin=origin, created_at=now, last_access_at=now,
                      status="active", metadata_json={})
        session.add(agent)
    agent.last_access_at = now
    if ttl_seconds is not None:
        agent.ttl_seconds = ttl_seconds
    if hot_ttl_seconds is not None:
        agent.hot_ttl_seconds = hot_ttl_seconds
    return agent


def start_request(session: Session, request_id: str, *, protocol: str, model: str | None,
                  served_model: str | None, stream: bool, agent_id: str | None,
                  n_input_tokens: int | None, now: datetime) -> None:
    session.add(Request(id=request_id, protocol=protocol, model=model, served_model=served_model,
                        stream=stream, agent_id=agent_id, n_input_tokens=n_input_tokens,
                        status="running", created_at=now))


def finish_request(session: Session, request_id: str, finished: Finished, now: datetime) -> None:
    row = session.get_one(Request, request_id)
    row.status = "cancelled" if finished.stop_reason == "cancelled" else "ok"
    row.stop_reason = finished.stop_reason
    row.n_input_tokens = finished.n_prompt_tokens
    row.n_cached_tokens = finished.n_cached_tokens
    row.n_output_tokens = finished.n_output_tokens
    row.match_outcome = finished.match_outcome
    row.ttft_ms = finished.ttft_s * 1000
    row.total_ms = finished.total_s * 1000
    row.finished_at = now


def fail_request(session: Session, request_id: str, *, status: str, error_type: str,
                 message: str, now: datetime, protocol: str | None = None) -> None:
    """Mark a request failed; creates the row if validation failed before it existed."""
    row = session.get(Request, request_id)
    if row is None:
        row = Request(id=request_id, protocol=protocol or "unknown", status=status, created_at=now)
        session.add(row)
    row.status = status
    if status == "cancelled":
        row.stop_reason = "cancelled"
    row.error_type = error_type
    row.error_message = message[:2000]
    row.finished_at = now


def append_history(session: Session, agent_id: str, messages: Sequence[tuple[str, Any]],
                   request_id: str, now: datetime) -> int:
    """Append the messages at positions the agent's history does not have yet.

    Stateless protocols resend the whole conversation each turn; only its new
    tail is stored. Returns the number of messages written.
    """
    n_stored = session.scalar(select(func.count()).where(Message.agent_id == agent_id)) or 0
    new = list(messages)[n_stored:]
    for offset, (role, content) in enumerate(new):
        session.add(Message(agent_id=agent_id, position=n_stored + offset, role=role,
                            content=content, created_at=now, request_id=request_id))
    return len(new)
