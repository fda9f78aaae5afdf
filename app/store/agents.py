"""Agent rows, their conversations and history, for the direct agent API and an agent's
archive (export reads them, import writes them). Functions take a Session."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, select
from sqlalchemy.orm import Session

from app.errors import InvalidRequest
from app.store import cache_index
from app.store.history import new_conversation_id
from app.store.models import Agent, Conversation, Message, Request, StoredResponse
from app.types import ForkPoint


@dataclass(frozen=True, slots=True)
class LastHit:
    at: datetime
    cached_tokens: int
    input_tokens: int  # the whole prompt, cached part included


@dataclass(frozen=True, slots=True)
class ConversationView:
    id: str
    n_messages: int
    created_at: datetime
    last_access_at: datetime
    caches: tuple[tuple[str, int, str], ...]  # (model fingerprint, cached tokens, tier)
    last_hit: LastHit | None  # its latest request that read from cache


@dataclass(frozen=True, slots=True)
class AgentView:
    id: str
    origin: str
    parent_id: str | None  # the agent this one was forked from
    created_at: datetime
    last_access_at: datetime
    ttl_seconds: int | None
    hot_ttl_seconds: int | None
    status: str
    metadata: dict[str, Any]
    n_messages: int
    conversations: tuple[ConversationView, ...]  # most recently used first


def create(session: Session, agent_id: str, metadata: dict[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    """False if the id is taken."""
    if session.get(Agent, agent_id) is not None:
        return False
    session.add(Agent(id=agent_id, origin="direct", created_at=now, last_access_at=now, ttl_seconds=ttl_seconds,
                      status="active", metadata_json=metadata))
    return True


def _conversations(session: Session, agent_id: str) -> tuple[ConversationView, ...]:
    counts: dict[str, int] = {c: n for c, n in session.execute(
        select(Message.conversation_id, func.count()).where(Message.agent_id == agent_id)
        .group_by(Message.conversation_id))}
    caches: dict[str, list[tuple[str, int, str]]] = {}
    for conversation_id, fingerprint, n_tokens, tier in cache_index.agents_caches(session, [agent_id]):
        caches.setdefault(conversation_id, []).append((fingerprint, n_tokens, tier))
    rows = session.scalars(select(Conversation).where(Conversation.agent_id == agent_id)
                           .order_by(Conversation.last_access_at.desc()))
    hits = _last_hits(session, agent_id)
    return tuple(ConversationView(c.id, counts.get(c.id, 0), c.created_at, c.last_access_at,
                                  tuple(caches.get(c.id, ())), hits.get(c.id)) for c in rows)


def _last_hits(session: Session, agent_id: str) -> dict[str, LastHit]:
    """Each conversation's latest request that read tokens from cache."""
    hit = and_(Request.agent_id == agent_id, Request.n_cached_tokens > 0)
    latest = (select(Request.conversation_id, func.max(Request.created_at).label("at")).where(hit)
              .group_by(Request.conversation_id).subquery())
    rows = session.execute(select(Request.conversation_id, Request.created_at, Request.n_cached_tokens,
                                  Request.n_input_tokens)
                           .join(latest, and_(Request.conversation_id == latest.c.conversation_id,
                                              Request.created_at == latest.c.at)).where(hit))
    return {c: LastHit(at, cached or 0, n_input or 0) for c, at, cached, n_input in rows if c is not None}


def view(session: Session, agent_id: str) -> AgentView | None:
    agent = session.get(Agent, agent_id)
    if agent is None:
        return None
    conversations = _conversations(session, agent_id)
    return AgentView(agent.id, agent.origin, agent.parent_id, agent.created_at, agent.last_access_at, agent.ttl_seconds,
                     agent.hot_ttl_seconds, agent.status, dict(agent.metadata_json or {}),
                     sum(c.n_messages for c in conversations), conversations)


def list_ids(session: Session, limit: int, offset: int) -> list[str]:
    return list(session.scalars(select(Agent.id).order_by(Agent.last_access_at.desc()).limit(limit).offset(offset)))


def history(session: Session, agent_id: str, conversation_id: str | None = None) -> list[Message]:
    """Messages of one conversation, or of all the agent's conversations (oldest conversation first)."""
    query = (select(Message).join(Conversation, Conversation.id == Message.conversation_id)
             .where(Message.agent_id == agent_id)
             .order_by(Conversation.created_at, Conversation.id, Message.position))
    if conversation_id is not None:
        query = query.where(Message.conversation_id == conversation_id)
    return list(session.scalars(query))


def conversation_protocols(session: Session, conversation_id: str) -> set[str]:
    """The protocols of the requests that stored the conversation's messages."""
    return set(session.scalars(select(Request.protocol).join(Message, Message.request_id == Request.id)
                               .where(Message.conversation_id == conversation_id).distinct()))


def latest_conversation(session: Session, agent_id: str) -> str | None:
    """The agent's most recently used conversation."""
    return session.scalar(select(Conversation.id).where(Conversation.agent_id == agent_id)
                          .order_by(Conversation.last_access_at.desc()).limit(1))


def remove(session: Session, agent_id: str) -> None:
    """Delete the agent, its conversations, messages and stored responses (requests keep their
    rows, unlinked)."""
    session.execute(delete(StoredResponse).where(StoredResponse.agent_id == agent_id))
    session.execute(delete(Message).where(Message.agent_id == agent_id))
    session.execute(delete(Conversation).where(Conversation.agent_id == agent_id))
    session.execute(delete(Agent).where(Agent.id == agent_id))


@dataclass(frozen=True, slots=True)
class Fork:
    """A forked agent's first conversation, copied from ``source_conversation``."""

    source_conversation: str
    conversation_id: str
    n_messages: int
    point: ForkPoint | None = None  # where the copied cache ends (None: the whole conversation is kept)


def fork(session: Session, source_id: str, new_id: str, metadata: dict[str, Any], at_turn: int | None,
         now: datetime) -> Fork | None:
    """A new agent (``parent_id`` = the source) whose one conversation is a copy of the source's
    most recently used conversation, up to and including its ``at_turn``-th reply (all of it
    when None; 0 keeps none). Its identity, TTLs and metadata are the source's (``metadata``
    added). None: the source has no conversation.

    Raises:
        InvalidRequest: the id is taken, or the conversation has fewer than ``at_turn`` replies.
    """
    source = session.get_one(Agent, source_id)
    if session.get(Agent, new_id) is not None:
        raise InvalidRequest(f"id: agent {new_id!r} already exists", "id")
    conversation_id = latest_conversation(session, source_id)
    if conversation_id is None:
        return None
    messages = history(session, source_id, conversation_id)
    replies = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if at_turn is not None and at_turn > len(replies):
        raise InvalidRequest(f"at_turn: the conversation has {len(replies)} turns, not {at_turn}", "at_turn")
    kept = messages if at_turn is None else messages[:replies[at_turn - 1] + 1] if at_turn else []
    conversation = session.get_one(Conversation, conversation_id)
    session.add(Agent(id=new_id, origin="direct", parent_id=source_id, created_at=now, last_access_at=now,
                      ttl_seconds=source.ttl_seconds, hot_ttl_seconds=source.hot_ttl_seconds, status="active",
                      metadata_json={**(source.metadata_json or {}), **metadata}))
    copy = Conversation(id=new_conversation_id(), agent_id=new_id, system_digest=conversation.system_digest,
                        snapshot=conversation.snapshot, created_at=now, last_access_at=now)
    session.add(copy)
    session.flush()
    session.add_all(Message(agent_id=new_id, conversation_id=copy.id, position=m.position, digest=m.digest,
                            role=m.role, content=m.content, created_at=m.created_at,
                            request_id=m.request_id) for m in kept)
    point = None if len(kept) == len(messages) else \
        ForkPoint(tuple(_first_text(m.content) for m in kept), _first_text(messages[len(kept)].content))
    return Fork(conversation_id, copy.id, len(kept), point)


def _first_text(content: Any) -> str:
    """The first text a stored message holds, whatever the protocol that stored it ("" if none):
    a string, a list of text parts (Anthropic, Responses), an OpenAI message with its content."""
    if isinstance(content, dict):
        content = content.get("content")
    if isinstance(content, list):
        content = next((part["text"] for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]), "")
    return content if isinstance(content, str) else ""


# -- an agent's archive (app/agents/portable.py) ------------------------------------------

@dataclass(frozen=True, slots=True)
class ArchivedMessage:
    """A message as an archive holds it, keeping its position, digest and time."""

    position: int
    role: str
    content: Any  # JSON as stored
    digest: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ArchivedConversation:
    """A conversation as an archive holds it, under the id the import gives it."""

    id: str
    system_digest: str | None
    snapshot: str | None
    thread: str | None
    created_at: datetime
    last_access_at: datetime
    messages: tuple[ArchivedMessage, ...]


def get(session: Session, agent_id: str) -> Agent | None:
    """The agent's row (None: no such agent)."""
    return session.get(Agent, agent_id)


def conversations(session: Session, agent_id: str) -> list[Conversation]:
    """The agent's conversations, oldest first."""
    return list(session.scalars(select(Conversation).where(Conversation.agent_id == agent_id)
                                .order_by(Conversation.created_at, Conversation.id)))


def add_imported(session: Session, agent_id: str, *, origin: str, created_at: datetime, now: datetime,
                 ttl_seconds: int | None, hot_ttl_seconds: int | None, status: str, metadata: dict[str, Any],
                 conversations: Sequence[ArchivedConversation]) -> None:
    """An imported agent (no parent: its source lives in another store), used ``now``, and its
    conversations with their messages, in the caller's transaction."""
    session.add(Agent(id=agent_id, origin=origin, parent_id=None, created_at=created_at, last_access_at=now,
                      ttl_seconds=ttl_seconds, hot_ttl_seconds=hot_ttl_seconds, status=status,
                      metadata_json=metadata))
    for conversation in conversations:
        session.add(Conversation(id=conversation.id, agent_id=agent_id, system_digest=conversation.system_digest,
                                 snapshot=conversation.snapshot, thread=conversation.thread,
                                 created_at=conversation.created_at, last_access_at=conversation.last_access_at))
        session.flush()
        session.add_all(Message(agent_id=agent_id, conversation_id=conversation.id, position=m.position,
                                role=m.role, content=m.content, digest=m.digest, created_at=m.created_at)
                        for m in conversation.messages)


def link_requests(session: Session, conversation_id: str, linked: dict[int, str]) -> None:
    """Point the conversation's messages at ``linked``'s positions to the request that wrote each."""
    if linked:
        for message in session.scalars(select(Message).where(Message.conversation_id == conversation_id,
                                                             Message.position.in_(linked))):
            message.request_id = linked[message.position]
