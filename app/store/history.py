"""Agents, conversations, requests and message history: the writes every protocol makes.

Each function takes a Session and commits nothing; callers keep transactions
short (one ``with session.begin()`` per step).

A conversation is recognised by content: each stored message carries the
digest of what the model saw (role and rendered text), and a request
continues the conversation whose stored digests are a prefix of its own
(same system prompt and tools). History is appended to that conversation
only, so side conversations sent under one identity never mix.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.store.db import insert_or_ignore
from app.store.models import Agent, Conversation, Message, Request
from app.types import Finished, ReuseReport

log = logging.getLogger(__name__)

# Conversations looked at when a request names no agent and is recognised by content.
CONTENT_CANDIDATES = 50


def new_conversation_id() -> str:
    return f"conv_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True, slots=True)
class ConversationMatch:
    """A stored conversation a request continues: it resends its ``n_messages`` messages."""

    agent_id: str
    conversation_id: str
    n_messages: int
    snapshot: str | None  # the system prompt's snapshot pinned at its start


def _digests(session: Session, conversation_ids: Sequence[str]) -> dict[str, list[str | None]]:
    found: dict[str, list[str | None]] = {c: [] for c in conversation_ids}
    rows = session.execute(select(Message.conversation_id, Message.digest)
                           .where(Message.conversation_id.in_(conversation_ids))
                           .order_by(Message.conversation_id, Message.position))
    for conversation_id, digest in rows:
        found[conversation_id].append(digest)
    return found


def _longest_prefix(candidates: Sequence[Conversation], stored: dict[str, list[str | None]],
                    digests: Sequence[str], minimum: int) -> ConversationMatch | None:
    """The candidate whose stored digests are a prefix of ``digests``, most messages first
    (then the most recently used)."""
    best: ConversationMatch | None = None
    for conversation in sorted(candidates, key=lambda c: c.last_access_at, reverse=True):
        mine = stored.get(conversation.id, [])
        if len(mine) < minimum or len(mine) > len(digests) or list(digests[:len(mine)]) != mine:
            continue
        if best is None or len(mine) > best.n_messages:
            best = ConversationMatch(conversation.agent_id, conversation.id, len(mine), conversation.snapshot)
    return best


def find_conversation(session: Session, agent_id: str, system_digest: str,
                      digests: Sequence[str], thread: str | None = None) -> ConversationMatch | None:
    """The agent's conversation that ``digests`` continue (same system prompt and tools, and
    the same client thread: a request naming none continues only conversations without one)."""
    candidates = list(session.scalars(select(Conversation).where(Conversation.agent_id == agent_id,
                                                                 Conversation.system_digest == system_digest,
                                                                 Conversation.thread.is_(None) if thread is None
                                                                 else Conversation.thread == thread)))
    return _longest_prefix(candidates, _digests(session, [c.id for c in candidates]), digests, minimum=0)


def find_by_content(session: Session, system_digest: str, digests: Sequence[str]) -> ConversationMatch | None:
    """For a request that names no agent: the stored conversation it resends and extends,
    among those of agents that were themselves recognised by content (never a named agent's:
    a client without a session id must not reach, or probe for, another's history); at least
    its first message must match."""
    if not digests:
        return None
    first = select(Message.conversation_id).where(Message.position == 0, Message.digest == digests[0])
    anonymous = select(Agent.id).where(Agent.origin == "content")
    candidates = list(session.scalars(
        select(Conversation).where(Conversation.id.in_(first), Conversation.system_digest == system_digest,
                                   Conversation.agent_id.in_(anonymous))
        .order_by(Conversation.last_access_at.desc()).limit(CONTENT_CANDIDATES)))
    return _longest_prefix(candidates, _digests(session, [c.id for c in candidates]), digests, minimum=1)


def touch_agent(session: Session, agent_id: str, origin: str, now: datetime, *,
                ttl_seconds: int | None = None, hot_ttl_seconds: int | None = None) -> Agent:
    """Get the agent, creating it on first sight; record the access and any TTL the request sets.
    (Another request of the same new agent may create the row at the same moment: the insert yields to it.)"""
    insert_or_ignore(session, Agent, id=agent_id, origin=origin, created_at=now, last_access_at=now,
                     status="active", metadata_json={})
    agent = session.get_one(Agent, agent_id)
    agent.last_access_at = now
    if ttl_seconds is not None:
        agent.ttl_seconds = ttl_seconds
    if hot_ttl_seconds is not None:
        agent.hot_ttl_seconds = hot_ttl_seconds
    return agent


def ensure_conversation(session: Session, conversation_id: str, agent_id: str, origin: str, now: datetime,
                        system_digest: str | None = None, snapshot: str | None = None,
                        thread: str | None = None) -> None:
    """Create the agent and the conversation rows if missing (two requests may be first;
    neither fails on the other's insert). The one writer of these rows for a turn: the cache
    persister writes none, and a cache row references its conversation, so this runs before
    the engine computes the turn (``AgentService.accept``)."""
    insert_or_ignore(session, Agent, id=agent_id, origin=origin, created_at=now, last_access_at=now,
                     status="active", metadata_json={})
    insert_or_ignore(session, Conversation, id=conversation_id, agent_id=agent_id, system_digest=system_digest,
                     snapshot=snapshot or None, thread=thread, created_at=now, last_access_at=now)
    if system_digest is not None:  # a row made without one (by an older server's cache persister)
        conversation = session.get_one(Conversation, conversation_id)
        conversation.system_digest = conversation.system_digest or system_digest
        conversation.snapshot = conversation.snapshot or snapshot or None
        conversation.thread = conversation.thread or thread


def _text(value: str | None) -> str | None:
    """Text a client sent, quoted into a diagnostic column: PostgreSQL's text holds no NUL
    (JSON columns keep it, escaped), so it becomes U+FFFD there on every store."""
    return None if value is None else value.replace("\x00", "\ufffd")


def start_request(session: Session, request_id: str, *, protocol: str, model: str | None,
                  served_model: str | None, stream: bool, n_input_tokens: int | None, now: datetime,
                  server_id: str | None = None) -> None:
    """The request's row, before the engine runs it (its agent and conversation are written
    when the engine takes it: ``claim_request``)."""
    session.add(Request(id=request_id, protocol=protocol, server_id=server_id, model=model,
                        served_model=served_model, stream=stream, n_input_tokens=n_input_tokens, status="running",
                        created_at=now))


def claim_request(session: Session, request_id: str, agent_id: str, conversation_id: str | None) -> None:
    """The engine took the request for ``agent_id``'s conversation: its row names them from
    now on, so a request the server never finished (``interrupt_unfinished``) says whose it
    was. A row that was never written (the store refused it) stays unwritten."""
    row = session.get(Request, request_id)
    if row is not None:
        row.agent_id, row.conversation_id = agent_id, conversation_id


def interrupt_unfinished(session: Session, server_id: str, now: datetime, *, alone: bool) -> int:
    """Mark the requests ``server_id`` left ``running`` (it stopped before they ended: a
    crash, a kill, a full disk) ``interrupted``; with ``alone`` (the only server of its store:
    SQLite, one server a home) every running row, those from before revision 0012 included.
    Returns how many."""
    unfinished = update(Request).where(Request.status == "running")
    if not alone:
        unfinished = unfinished.where(Request.server_id == server_id)
    result = session.execute(unfinished.values(
        status="interrupted", error_type="interrupted",
        error_message="the server stopped before the request ended (it was started again)", finished_at=now))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def finish_request(session: Session, request_id: str, finished: Finished, now: datetime, *,
                   agent_id: str | None = None, conversation_id: str | None = None,
                   reuse: ReuseReport | None = None) -> None:
    row = session.get_one(Request, request_id)
    row.status = "cancelled" if finished.stop_reason == "cancelled" else "ok"
    row.stop_reason = finished.stop_reason
    row.agent_id = agent_id or row.agent_id
    row.conversation_id = conversation_id or row.conversation_id
    row.n_input_tokens = finished.n_prompt_tokens
    row.n_cached_tokens = finished.n_cached_tokens
    row.n_output_tokens = finished.n_output_tokens
    row.ttft_ms = finished.ttft_s * 1000
    row.queue_ms, row.restore_ms = finished.queue_s * 1000, finished.restore_s * 1000
    row.prefill_ms = finished.prefill_s * 1000
    row.total_ms = finished.total_s * 1000
    row.finished_at = now
    if reuse is not None:
        row.reuse_reason, row.n_reused_chars, row.cache_source = reuse.reason, reuse.n_chars, reuse.source
        row.diverge_offset, row.diverge_part = reuse.offset, reuse.part
        row.diverge_stored, row.diverge_new = _text(reuse.stored), _text(reuse.new)


def fail_request(session: Session, request_id: str, *, status: str, error_type: str, message: str, now: datetime,
                 protocol: str | None = None, agent_id: str | None = None, conversation_id: str | None = None) -> None:
    """Mark a request failed; creates the row if validation failed before it existed."""
    row = session.get(Request, request_id)
    if row is None:
        row = Request(id=request_id, protocol=protocol or "unknown", status=status, created_at=now)
        session.add(row)
    row.agent_id = agent_id or row.agent_id
    row.conversation_id = conversation_id or row.conversation_id
    row.status = status
    if status == "cancelled":
        row.stop_reason = "cancelled"
    row.error_type = error_type
    row.error_message = _text(message[:2000])
    row.finished_at = now


def import_requests(session: Session, rows: Sequence[dict[str, Any]]) -> frozenset[str]:
    """Add request rows an agent's archive holds (``rows``: each one's column values, checked
    by the caller), flushed; a row whose id this store holds already is skipped (it stays
    its owner's). Returns the ids written."""
    written: set[str] = set()
    for values in rows:
        if session.get(Request, values["id"]) is None:
            session.add(Request(**values))
            written.add(values["id"])
    session.flush()
    return frozenset(written)


@dataclass(frozen=True, slots=True)
class StoredMessage:
    role: str
    content: Any  # JSON as received
    digest: str


def append_messages(session: Session, agent_id: str, conversation_id: str, messages: Sequence[StoredMessage],
                    request_id: str, now: datetime) -> str:
    """Append to a conversation the messages it does not hold yet; returns the conversation
    they are in.

    ``messages`` is the whole conversation as the request resent it, plus the reply. The
    stored messages were a prefix of it when the conversation was chosen; if another turn
    of the same conversation finished first with other messages (two racing turns), they
    are no longer, and this turn's messages go into a new conversation forked from it, so
    neither turn's history is lost.
    """
    stored = list(session.scalars(select(Message.digest).where(Message.conversation_id == conversation_id)
                                  .order_by(Message.position)))
    if any(digest is not None and digest != message.digest for digest, message in zip(stored, messages)):
        conversation_id, stored = _fork(session, conversation_id, now), []  # rows from before digests match any
    for offset, message in enumerate(messages[len(stored):]):
        session.add(Message(agent_id=agent_id, conversation_id=conversation_id, position=len(stored) + offset,
                            role=message.role, content=message.content, digest=message.digest,
                            created_at=now, request_id=request_id))
    session.get_one(Conversation, conversation_id).last_access_at = now
    return conversation_id


def _fork(session: Session, conversation_id: str, now: datetime) -> str:
    """A new conversation of the same agent, system prompt, snapshot and thread."""
    source = session.get_one(Conversation, conversation_id)
    fork = Conversation(id=new_conversation_id(), agent_id=source.agent_id, system_digest=source.system_digest,
                        snapshot=source.snapshot, thread=source.thread, created_at=now, last_access_at=now)
    session.add(fork)
    session.flush()
    log.info("conversation %s: a racing turn's history went to a fork, %s", conversation_id, fork.id)
    return fork.id
