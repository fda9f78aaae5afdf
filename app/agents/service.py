"""AgentService: the store-side lifecycle of a generation request.

Resources call it at three moments: a request was rejected, a generation
starts, a generation finished (or failed). Each call is one short transaction,
so the worker and other requests are never blocked for long and history
committed before a crash stays committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from sqlalchemy.orm import Session, sessionmaker

from app.agents.identity import AgentKey
from app.cache.hashing import chain_hashes
from app.errors import InvalidRequest, NotFound
from app.store import agents as agents_store
from app.store import blockfiles, cache_index, history
from app.types import Finished


class AgentService:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._sessions = session_factory

    def resume_by_content(self, fingerprint: str, token_ids: Sequence[int], text: str,
                          block_tokens: int) -> AgentKey | None:
        """The agent a stateless request continues, found by its content.

        An agent qualifies when its whole cached block chain starts the prompt's
        chain and its cached text is a prefix of the prompt (the request resends
        that agent's conversation and adds to it). A shared system prompt alone
        does not qualify: the other agent's text would not be a prefix.
        """
        chain = chain_hashes(fingerprint, token_ids, block_tokens)
        with self._sessions() as session:
            candidates = cache_index.candidates_for_chain(session, fingerprint, chain)
        for agent_id, record_path, _ in candidates:
            try:
                cached_text = blockfiles.read_metadata(Path(record_path)).get("text", "")
            except blockfiles.DamagedFile:
                continue
            if cached_text and text.startswith(cached_text):
                return AgentKey(agent_id, "content")
        return None

    def n_stored_caches(self, fingerprint: str) -> int:
        with self._sessions() as session:
            return cache_index.count_caches(session, fingerprint)

    def create(self, agent_id: str, metadata: dict[str, Any], ttl_seconds: int | None) -> agents_store.AgentView:
        """Raises InvalidRequest if the id is taken."""
        with self._sessions.begin() as session:
            if not agents_store.create(session, agent_id, metadata, ttl_seconds, history.utcnow()):
                raise InvalidRequest(f"id: agent {agent_id!r} already exists", "id")
        return self.get(agent_id)

    def get(self, agent_id: str) -> agents_store.AgentView:
        """Raises NotFound."""
        with self._sessions() as session:
            found = agents_store.view(session, agent_id)
        if found is None:
            raise NotFound(f"agent {agent_id!r} does not exist")
        return found

    def list(self, limit: int, offset: int) -> list[agents_store.AgentView]:
        with self._sessions() as session:
            ids = agents_store.list_ids(session, limit, offset)
            return [v for v in (agents_store.view(session, i) for i in ids) if v is not None]

    def history(self, agent_id: str) -> list[dict[str, Any]]:
        self.get(agent_id)
        with self._sessions() as session:
            return [{"position": m.position, "role": m.role, "content": m.content,
                     "created_at": m.created_at.isoformat() + "Z", "request_id": m.request_id}
                    for m in agents_store.history(session, agent_id)]

    def delete(self, agent_id: str) -> None:
        self.get(agent_id)
        with self._sessions.begin() as session:
            agents_store.remove(session, agent_id)

    def reject(self, request_id: str, protocol: str, error_type: str, message: str) -> None:
        """Record a request refused before generation (bad input, overload)."""
        with self._sessions.begin() as session:
            history.fail_request(session, request_id, status="rejected", error_type=error_type,
                                 message=message, now=history.utcnow(), protocol=protocol)

    def begin(self, request_id: str, agent: AgentKey, *, protocol: str, model: str,
              served_model: str, stream: bool, n_input_tokens: int, ttl_seconds: int | None = None,
              hot_ttl_seconds: int | None = None) -> None:
        now = history.utcnow()
        with self._sessions.begin() as session:
            history.touch_agent(session, agent.agent_id, agent.origin, now, ttl_seconds=ttl_seconds,
                                hot_ttl_seconds=hot_ttl_seconds)
            history.start_request(session, request_id, protocol=protocol, model=model,
                                  served_model=served_model, stream=stream,
                                  agent_id=agent.agent_id, n_input_tokens=n_input_tokens, now=now)

    def complete(self, request_id: str, agent: AgentKey, messages: Sequence[tuple[str, Any]],
                 reply: tuple[str, Any], finished: Finished) -> None:
        """Record the outcome and append the conversation's new messages and the reply."""
        now = history.utcnow()
        with self._sessions.begin() as session:
            history.finish_request(session, request_id, finished, now)
            if finished.stop_reason != "cancelled":
                history.append_history(session, agent.agent_id, [*messages, reply], request_id, now)

    def fail(self, request_id: str, error_type: str, message: str, status: str = "error") -> None:
        """Record a generation that ended without a result (``status``: error / cancelled)."""
        with self._sessions.begin() as session:
            history.fail_request(session, request_id, status=status, error_type=error_type,
                                 message=message, now=history.utcnow())
