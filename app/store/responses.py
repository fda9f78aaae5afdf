"""Stored Responses API responses: each is a point in a conversation's history. Functions take a Session.

A response's input and output are the first ``n_messages`` messages of its conversation
(the history every protocol keeps), so ``previous_response_id`` continues from exactly
there, even after later turns of the conversation or a branch from an earlier response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.store.models import Conversation, Message, StoredResponse


@dataclass(frozen=True, slots=True)
class ResponsePoint:
    """Where a stored response sits: its agent, conversation, thread and history up to its output."""

    response_id: str
    agent_id: str
    conversation_id: str
    thread: str | None
    items: tuple[Any, ...]  # the stored content of its conversation's first n_messages messages


def save(session: Session, response_id: str, *, request_id: str, agent_id: str, conversation_id: str,
         previous_response_id: str | None, body: dict[str, Any], now: datetime) -> None:
    """Keep ``body`` (the response object as returned) after its turn's messages were appended:
    the response covers the conversation as it stands."""
    n_messages = session.scalar(select(func.count()).where(Message.conversation_id == conversation_id)) or 0
    session.add(StoredResponse(id=response_id, agent_id=agent_id, conversation_id=conversation_id,
                               request_id=request_id, previous_response_id=previous_response_id,
                               n_messages=n_messages, status=str(body.get("status", "completed")),
                               model=body.get("model"), body=body, created_at=now))


def import_responses(session: Session, rows: Sequence[dict[str, Any]]) -> int:
    """Add stored responses an agent's archive holds (``rows``: each one's column values,
    checked by the caller); one whose id this store holds already is skipped (it stays its
    owner's). Returns how many were written."""
    n_written = 0
    for values in rows:
        if session.get(StoredResponse, values["id"]) is None:
            session.add(StoredResponse(**values))
            n_written += 1
    return n_written


def get(session: Session, response_id: str) -> dict[str, Any] | None:
    row = session.get(StoredResponse, response_id)
    return None if row is None else dict(row.body)


def point(session: Session, response_id: str) -> ResponsePoint | None:
    """The history a response continues from (None: no such stored response)."""
    row = session.get(StoredResponse, response_id)
    if row is None:
        return None
    thread = session.scalar(select(Conversation.thread).where(Conversation.id == row.conversation_id))
    contents = session.scalars(select(Message.content).where(Message.conversation_id == row.conversation_id)
                               .order_by(Message.position).limit(row.n_messages))
    return ResponsePoint(row.id, row.agent_id, row.conversation_id, thread, tuple(contents))


def delete(session: Session, response_id: str) -> bool:
    """Forget a stored response (its conversation's history stays). False if there was none."""
    row = session.get(StoredResponse, response_id)
    if row is None:
        return False
    session.delete(row)
    return True
