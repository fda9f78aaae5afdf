"""AgentService: the store-side lifecycle of a generation request.

Resources call it at four moments: which conversation a request continues
(read only), a generation is accepted, it finished, it failed. Each is one
short transaction, so the worker and other requests are never blocked for
long and history committed before a crash stays committed. Nothing about an
agent is written before the engine accepted its request. A database locked
past the busy timeout is a 503 (``StoreBusy``) before generation; a finished
turn's history is retried first.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from app.agents.identity import AgentKey, new_agent
from app.clock import utcnow
from app.errors import InvalidRequest, NotFound, StoreBusy
from app.store import agents as agents_store
from app.store import cache_index, history, responses
from app.store.db import with_retries
from app.store.history import StoredMessage
from app.types import Finished, ReuseReport

log = logging.getLogger(__name__)

# A finished turn's history write is tried this often (each waits out the busy
# timeout, then backs off) before the request fails with 503.
COMPLETE_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class ConversationTarget:
    """The agent and conversation a request belongs to."""

    agent: AgentKey
    conversation_id: str
    system_digest: str
    n_stored: int  # messages of the conversation already stored (0 for a new one)
    snapshot: str | None = None  # pinned at the conversation's start (None: a new conversation pins its own)


@dataclass(frozen=True, slots=True)
class StoredReply:
    """A response object to keep with its turn (Responses API ``store``)."""

    response_id: str
    previous_id: str | None
    body: dict[str, Any]


class AgentService:
    def __init__(self, session_factory: sessionmaker[Session], server_id: str | None = None) -> None:
        """``server_id``: the server whose requests this records (each row names it)."""
        self._sessions = session_factory
        self._server_id = server_id

    def interrupt_unfinished(self, *, alone: bool) -> int:
        """At start: mark the requests this server left running ``interrupted`` (``alone``:
        the store's only server, every running row); how many."""
        with self._sessions.begin() as session:
            return history.interrupt_unfinished(session, self._server_id or "", utcnow(), alone=alone)

    def resolve(self, named: AgentKey | None, system_digest: str, digests: Sequence[str]) -> ConversationTarget:
        """The conversation a request continues, by content: the one whose stored messages
        it resends (same system prompt and tools), of the named agent, or of any agent
        when none is named; else a new conversation (of a new agent if none is named)."""
        with self._sessions() as session:
            if named is not None:
                found = history.find_conversation(session, named.agent_id, system_digest, digests, named.thread)
                agent = named
            else:
                found = history.find_by_content(session, system_digest, digests)
                agent = AgentKey(found.agent_id, "content") if found else new_agent()
        if found is None:
            return ConversationTarget(agent, history.new_conversation_id(), system_digest, 0)
        return ConversationTarget(agent, found.conversation_id, system_digest, found.n_messages, found.snapshot)

    def count_tiers(self, hot: Collection[str]) -> cache_index.TierCounts:
        """Conversations by tier (``cache_index.Tier``); ``hot``: those held in memory."""
        with self._sessions() as session:
            return cache_index.count_tiers(session, hot)

    def create(self, agent_id: str, metadata: dict[str, Any], ttl_seconds: int | None,
               conversation: tuple[str, str] | None = None) -> agents_store.AgentView:
        """Create a direct-API agent, and optionally its first, empty conversation
        (``(conversation id, system digest)``) whose start is about to be prefilled.

        Raises:
            InvalidRequest: the id is taken.
        """
        now = utcnow()
        with self._sessions.begin() as session:
            if not agents_store.create(session, agent_id, metadata, ttl_seconds, now):
                raise InvalidRequest(f"id: agent {agent_id!r} already exists", "id")
            if conversation is not None:
                history.ensure_conversation(session, conversation[0], agent_id, "direct", now, conversation[1])
        return self.get(agent_id)

    def fork(self, source_id: str, new_id: str, metadata: dict[str, Any],
             at_turn: int | None) -> agents_store.Fork | None:
        """A new agent continuing the source's most recent conversation (up to its
        ``at_turn``-th reply): its history is copied now, its cache by the caller.

        Raises:
            NotFound: no such source agent. InvalidRequest: the id is taken, or ``at_turn`` is
            past the conversation's end.
        """
        self.get(source_id)
        with self._sessions.begin() as session:
            return agents_store.fork(session, source_id, new_id, metadata, at_turn, utcnow())

    def get(self, agent_id: str) -> agents_store.AgentView:
        """Raises NotFound."""
        with self._sessions() as session:
            return _found(agents_store.view(session, agent_id), f"agent {agent_id!r}")

    def list(self, limit: int, offset: int) -> list[agents_store.AgentView]:
        with self._sessions() as session:
            ids = agents_store.list_ids(session, limit, offset)
            return [v for v in (agents_store.view(session, i) for i in ids) if v is not None]

    def history(self, agent_id: str, latest_only: bool = False) -> builtins.list[dict[str, Any]]:
        """The agent's messages: every conversation's, or only its most recently used one's."""
        self.get(agent_id)
        with self._sessions() as session:
            conversation = agents_store.latest_conversation(session, agent_id) if latest_only else None
            if latest_only and conversation is None:
                return []
            return [{"conversation_id": m.conversation_id, "position": m.position, "role": m.role,
                     "content": m.content, "created_at": m.created_at.isoformat() + "Z", "request_id": m.request_id}
                    for m in agents_store.history(session, agent_id, conversation)]

    def latest_protocols(self, agent_id: str) -> set[str]:
        """The protocols that wrote the agent's most recently used conversation (empty: none)."""
        with self._sessions() as session:
            conversation = agents_store.latest_conversation(session, agent_id)
            return agents_store.conversation_protocols(session, conversation) if conversation else set()

    def delete(self, agent_id: str) -> None:
        self.get(agent_id)
        with self._sessions.begin() as session:
            agents_store.remove(session, agent_id)

    def response(self, response_id: str) -> dict[str, Any]:
        """A stored response object. Raises NotFound."""
        with self._sessions() as session:
            return _found(responses.get(session, response_id), f"response {response_id!r}")

    def response_point(self, response_id: str) -> responses.ResponsePoint:
        """The history a stored response continues from. Raises NotFound."""
        with self._sessions() as session:
            return _found(responses.point(session, response_id), f"response {response_id!r}")

    def delete_response(self, response_id: str) -> None:
        """Raises NotFound."""
        with self._sessions.begin() as session:
            if not responses.delete(session, response_id):
                raise NotFound(f"response {response_id!r} does not exist")

    def reject(self, request_id: str, protocol: str, error_type: str, message: str) -> None:
        """Record a request refused before generation (bad input, overload)."""
        def write() -> None:
            with self._sessions.begin() as session:
                history.fail_request(session, request_id, status="rejected", error_type=error_type,
                                     message=message, now=utcnow(), protocol=protocol)

        self._best_effort(write, f"request {request_id}: its rejection")

    def begin(self, request_id: str, *, protocol: str, model: str, served_model: str, stream: bool,
              n_input_tokens: int) -> None:
        """The request's row, as it goes to the engine."""
        def write() -> None:
            with self._sessions.begin() as session:
                history.start_request(session, request_id, protocol=protocol, model=model,
                                      served_model=served_model, stream=stream, n_input_tokens=n_input_tokens,
                                      now=utcnow(), server_id=self._server_id)

        with_retries(write, attempts=1)

    def accept(self, request_id: str, target: ConversationTarget, snapshot: str, *, ttl_seconds: int | None = None,
               hot_ttl_seconds: int | None = None) -> None:
        """The engine took the request: the agent (with the TTLs it asks for) and its
        conversation exist from now on (before the engine can store a cache for them), and
        the request's row names them; a new conversation pins ``snapshot``."""
        now = utcnow()

        def write() -> None:
            with self._sessions.begin() as session:
                history.touch_agent(session, target.agent.agent_id, target.agent.origin, now,
                                    ttl_seconds=ttl_seconds, hot_ttl_seconds=hot_ttl_seconds)
                history.ensure_conversation(session, target.conversation_id, target.agent.agent_id,
                                            target.agent.origin, now, target.system_digest, snapshot,
                                            target.agent.thread)
                history.claim_request(session, request_id, target.agent.agent_id, target.conversation_id)

        with_retries(write, attempts=1)

    def complete(self, request_id: str, target: ConversationTarget, messages: Sequence[StoredMessage],
                 finished: Finished, reuse: ReuseReport | None = None,
                 response: StoredReply | None = None) -> None:
        """Record the outcome, and append to the conversation the messages it does not hold
        yet (``messages`` ends with the reply), with the response object to keep if any
        (Responses API ``store``). A cancelled turn stores no history."""
        now = utcnow()
        agent_id, conversation_id = target.agent.agent_id, target.conversation_id

        def write() -> None:
            with self._sessions.begin() as session:
                history.touch_agent(session, agent_id, target.agent.origin, now)
                stored_in = conversation_id
                if finished.stop_reason != "cancelled":
                    stored_in = history.append_messages(session, agent_id, conversation_id, messages, request_id, now)
                    if response is not None:
                        responses.save(session, response.response_id, request_id=request_id, agent_id=agent_id,
                                       conversation_id=stored_in, previous_response_id=response.previous_id,
                                       body=response.body, now=now)
                history.finish_request(session, request_id, finished, now, agent_id=agent_id,
                                       conversation_id=stored_in, reuse=reuse)

        with_retries(write, attempts=COMPLETE_ATTEMPTS)  # the reply exists: keep trying to store it

    def fail(self, request_id: str, target: ConversationTarget, error_type: str, message: str,
             status: str = "error") -> None:
        """Record a generation that ended without a result (``status``: error / cancelled)."""
        def write() -> None:
            with self._sessions.begin() as session:
                history.fail_request(session, request_id, status=status, error_type=error_type, message=message,
                                     now=utcnow(), agent_id=target.agent.agent_id,
                                     conversation_id=target.conversation_id)

        self._best_effort(write, f"request {request_id}: its {status} outcome")

    @staticmethod
    def _best_effort(write: Callable[[], None], what: str) -> None:
        """Record an outcome the client is already being told about; a busy store only costs the row."""
        try:
            with_retries(write, attempts=2)
        except StoreBusy:
            log.error("%s was not recorded: the database stayed locked", what)


T = TypeVar("T")


def _found(value: T | None, what: str) -> T:
    """``value``, or NotFound naming ``what`` if there is none."""
    if value is None:
        raise NotFound(f"{what} does not exist")
    return value
