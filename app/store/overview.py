"""What an operator looks at first, read from the store: agents with their conversations and
hit rates, the latest cache misses and why. Functions take a Session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.store import cache_index
from app.store.models import Agent, Conversation, Message, Request


@dataclass(frozen=True, slots=True)
class ConversationRow:
    id: str
    n_messages: int
    cached_tokens: int  # on disk (warm); the page adds what is in memory
    tier: str  # warm / cold (cache_index.tier_of, none in memory: the page knows which are hot); none: no cache
    last_access_at: datetime
    last_turn: LastTurnCache | None = None  # where its latest turn's cache came from (None: no turn ran)


@dataclass(frozen=True, slots=True)
class LastTurnCache:
    """A conversation's latest turn's cache provenance (the ``x-semantic-cache`` header it got)."""

    source: str | None  # app.types.CacheSource (None: a row from before migration 0011)
    reason: str  # app.types.ReuseReason
    n_cached: int


@dataclass(frozen=True, slots=True)
class AgentRow:
    id: str
    origin: str
    last_access_at: datetime
    turns: int
    hit_rate: float | None
    conversations: tuple[ConversationRow, ...]


@dataclass(frozen=True, slots=True)
class MissRow:
    request_id: str
    created_at: datetime
    agent_id: str | None
    reason: str
    n_cached: int
    n_input: int
    part: str | None
    stored: str | None
    new: str | None


def agents(session: Session, limit: int = 50) -> list[AgentRow]:
    """The most recently used agents, each with its conversations (most recent first)."""
    rows = list(session.scalars(select(Agent).order_by(Agent.last_access_at.desc()).limit(limit)))
    ids = [a.id for a in rows]
    hits = {agent: (turns, rate) for agent, turns, rate in session.execute(text(
        "SELECT h.agent_id, t.turns, h.hit_rate FROM agent_cache_hits h JOIN agent_turns t USING (agent_id)"))}
    counts: dict[str, int] = {c: n for c, n in session.execute(
        select(Message.conversation_id, func.count()).where(Message.agent_id.in_(ids))
        .group_by(Message.conversation_id))}
    tokens: dict[str, int] = {}
    tiers: dict[str, list[str]] = {}
    for conversation_id, _, n_tokens, tier in cache_index.agents_caches(session, ids):
        tokens[conversation_id] = max(n_tokens, tokens.get(conversation_id, 0))
        tiers.setdefault(conversation_id, []).append(tier)
    last_turns = _last_turns(session, ids)
    conversations: dict[str, list[ConversationRow]] = {}
    for c in session.scalars(select(Conversation).where(Conversation.agent_id.in_(ids))
                             .order_by(Conversation.last_access_at.desc())):
        tier = cache_index.tier_of(False, tiers[c.id]) if c.id in tiers else "none"
        conversations.setdefault(c.agent_id, []).append(
            ConversationRow(c.id, counts.get(c.id, 0), tokens.get(c.id, 0), tier, c.last_access_at,
                            last_turns.get(c.id)))
    return [AgentRow(a.id, a.origin, a.last_access_at, hits.get(a.id, (0, None))[0], hits.get(a.id, (0, None))[1],
                     tuple(conversations.get(a.id, ()))) for a in rows]


def _last_turns(session: Session, agent_ids: list[str]) -> dict[str, LastTurnCache]:
    """The cache provenance of each conversation's latest turn that ran, by conversation."""
    latest = (select(Request.conversation_id, func.max(Request.created_at).label("at"))
              .where(Request.agent_id.in_(agent_ids), Request.reuse_reason.is_not(None))
              .group_by(Request.conversation_id).subquery())
    rows = session.execute(select(Request.conversation_id, Request.cache_source, Request.reuse_reason,
                                  Request.n_cached_tokens)
                           .join(latest, (Request.conversation_id == latest.c.conversation_id)
                                 & (Request.created_at == latest.c.at)))
    return {c: LastTurnCache(source, reason or "miss", n or 0) for c, source, reason, n in rows if c is not None}


def recent_misses(session: Session, limit: int = 20) -> list[MissRow]:
    """The latest requests that did not simply continue their conversation's cache."""
    rows = session.execute(text(
        "SELECT request_id, created_at, agent_id, reuse_reason, n_cached_tokens, n_input_tokens, diverge_part, "
        "diverge_stored, diverge_new FROM cache_misses ORDER BY created_at DESC LIMIT :limit"), {"limit": limit})
    return [MissRow(r[0], datetime.fromisoformat(str(r[1])), r[2], r[3], r[4] or 0, r[5] or 0, r[6], r[7], r[8])
            for r in rows]
