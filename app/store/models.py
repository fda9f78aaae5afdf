"""The SQL schema: a public interface (docs/sql.md), changed only by Alembic.

Times are UTC. JSON columns hold what clients sent, as received.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, MetaData, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Agent(Base):
    """An agent: the identity a conversation and its caches belong to."""

    __tablename__ = "agents"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # How the agent was identified: direct / openai / anthropic / content.
    origin: Mapped[str] = mapped_column(String(16))
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    created_at: Mapped[datetime]
    last_access_at: Mapped[datetime] = mapped_column(index=True)
    # Seconds a cache is kept after last access (direct API, OpenAI ``ttl``; 0 = never
    # written to disk); NULL = the server's default.
    ttl_seconds: Mapped[int | None]
    # Seconds to keep the cache in memory after last access, from Anthropic
    # ``cache_control`` hints (ephemeral = 300, "1h" = 3600); NULL = no hint.
    hot_ttl_seconds: Mapped[int | None]
    status: Mapped[str] = mapped_column(String(16), default="active")
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Conversation(Base):
    """One conversation of an agent: its own history and its own cache.

    Real clients send several conversations under one identity (Claude Code's
    title request, subagents and summaries share the main session id). A
    request continues the conversation whose stored messages it resends (by
    content: the digest of each message as the model sees it), else it starts
    a new one.
    """

    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    agent_id: Mapped[str] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), index=True)
    # Digest of what the prompt holds besides its messages (system prompt, tools).
    system_digest: Mapped[str | None] = mapped_column(String(32))
    # The snapshot closing the system prompt kept from the conversation's first request
    # (Claude Code's git status, app.protocol.claude_code); NULL if none.
    snapshot: Mapped[str | None]
    # The client's own name for the thread this conversation is (Codex ``thread-id``, with
    # ``x-openai-subagent`` for a side request; Claude Code's ``x-claude-code-agent-id`` for a
    # subagent): a request naming a thread continues only that thread's conversations.
    # NULL: recognised by content alone.
    thread: Mapped[str | None] = mapped_column(String(300))  # child-of:<128>/<128> at most
    created_at: Mapped[datetime]
    last_access_at: Mapped[datetime] = mapped_column(index=True)


class Request(Base):
    """One generation request, whatever its protocol and outcome."""

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    agent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"), index=True)
    conversation_id: Mapped[str | None] = mapped_column(ForeignKey("conversations.id", ondelete="SET NULL"),
                                                        index=True)
    protocol: Mapped[str] = mapped_column(String(16))  # anthropic / openai / responses / direct / ollama (protocol_of)
    server_id: Mapped[str | None] = mapped_column(String(128))  # the server that ran it (NULL: before 0012)
    model: Mapped[str | None] = mapped_column(String(256))  # as requested
    served_model: Mapped[str | None] = mapped_column(String(256))
    stream: Mapped[bool] = mapped_column(default=False)
    n_input_tokens: Mapped[int | None]  # whole prompt, cached part included
    n_cached_tokens: Mapped[int | None]  # reused from a cache
    n_output_tokens: Mapped[int | None]
    # How reuse ended (app.types.ReuseReason; NULL when no generation ran) and cache-miss
    # diagnostics: why less than the whole prompt came from cache, how many characters did,
    # and where the best stored text parted from the prompt:
    # the character offset, the piece of the prompt it fell in ("system", "tools",
    # "messages.N", "template") and a short excerpt of the stored and the new text there.
    reuse_reason: Mapped[str | None] = mapped_column(String(32))
    n_reused_chars: Mapped[int | None]
    diverge_offset: Mapped[int | None]
    diverge_part: Mapped[str | None] = mapped_column(String(64))
    diverge_stored: Mapped[str | None]
    diverge_new: Mapped[str | None]
    # Where the reused prefix was read from (app.types.CacheSource: memory / disk / tier / none;
    # the x-semantic-cache header's source). NULL when no generation ran, and before 0011.
    cache_source: Mapped[str | None] = mapped_column(String(16))
    # Times from the request's arrival: to the first token (0 when none came), in its three
    # parts (they add up to ttft_ms: arrival until the engine took it, its cache brought into
    # memory, the prompt computed until the first token; NULL in rows from before 0009), to the end.
    ttft_ms: Mapped[float | None]
    queue_ms: Mapped[float | None]
    restore_ms: Mapped[float | None]
    prefill_ms: Mapped[float | None]
    total_ms: Mapped[float | None]
    # running / ok / error / rejected / cancelled / interrupted (its server stopped before it ended:
    # a crash, a kill, a full disk; marked by the server's next start)
    status: Mapped[str] = mapped_column(String(16), index=True)
    stop_reason: Mapped[str | None] = mapped_column(String(32))
    error_type: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None]
    created_at: Mapped[datetime] = mapped_column(index=True)
    finished_at: Mapped[datetime | None]


class Message(Base):
    """One message of a conversation's history, in order (``position`` counts within it)."""

    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("conversation_id", "position"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), index=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    position: Mapped[int]
    # The message as the model saw it (role and rendered text), hashed: how a resent
    # conversation is recognised. NULL for messages stored before conversations existed.
    digest: Mapped[str | None] = mapped_column(String(32), index=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[Any] = mapped_column(JSON)
    created_at: Mapped[datetime]
    request_id: Mapped[str | None] = mapped_column(ForeignKey("requests.id", ondelete="SET NULL"), index=True)


class StoredResponse(Base):
    """A Responses API response kept for ``GET /v1/responses/{id}`` and ``previous_response_id``
    (``store``, true by default). Its input and output are the first ``n_messages`` messages
    of its conversation; ``body`` is the response object as it was returned."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    agent_id: Mapped[str] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), index=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    request_id: Mapped[str | None] = mapped_column(ForeignKey("requests.id", ondelete="SET NULL"), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    n_messages: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))  # completed / incomplete
    model: Mapped[str | None] = mapped_column(String(256))
    body: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(index=True)


class Cache(Base):
    """A conversation's KV cache for one model fingerprint."""

    __tablename__ = "caches"
    __table_args__ = (UniqueConstraint("conversation_id", "model_fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), index=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    n_tokens: Mapped[int] = mapped_column(default=0)
    tier: Mapped[str] = mapped_column(String(8))  # warm / cold (hot is a server's memory: cache_index.Tier)
    # File holding the cache record (tokens, text, char ends) and the private tail.
    record_path: Mapped[str | None]
    # sha256 of that file (``app.cache.files.checksum``), verified on every read (NULL: a row
    # from before revision 0008, checked against the file's own checksum alone).
    record_checksum: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    last_access_at: Mapped[datetime] = mapped_column(index=True)


class Block(Base):
    """A content-addressed block of 256 tokens' KV data, shared by reference."""

    __tablename__ = "blocks"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    parent_hash: Mapped[str | None] = mapped_column(String(64))
    n_tokens: Mapped[int]
    path: Mapped[str | None]
    nbytes: Mapped[int]
    checksum: Mapped[str | None] = mapped_column(String(64))
    # Hybrid models: the recurrent state after this block's tokens (and all before it), a
    # checkpoint any conversation starting with them may resume from (revision 0010).
    checkpoint_path: Mapped[str | None]
    checkpoint_checksum: Mapped[str | None] = mapped_column(String(64))
    checkpoint_nbytes: Mapped[int | None]
    ref_count: Mapped[int] = mapped_column(default=0)
    tier: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime]
    last_access_at: Mapped[datetime] = mapped_column(index=True)


class CacheBlock(Base):
    """Which blocks, in order, make up a cache."""

    __tablename__ = "cache_blocks"

    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(primary_key=True)
    block_hash: Mapped[str] = mapped_column(ForeignKey("blocks.hash"))

    __table_args__ = (Index("ix_cache_blocks_block_hash", "block_hash"),)


class Owner(Base):
    """The server of a pool that owns an agent's live cache (app.store.ownership)."""

    __tablename__ = "owners"

    agent_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    server_id: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int]  # one more at every change of owner
    taken_at: Mapped[datetime]


class JobRun(Base):
    """One run of a worker job and what it did."""

    __tablename__ = "job_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(32), index=True)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[dict[str, Any]] = mapped_column(default=dict)
