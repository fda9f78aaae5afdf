"""The direct, stateful agent API: the server keeps history, clients send only new messages.

POST /v1/agents, GET /v1/agents, GET|DELETE /v1/agents/{id},
POST /v1/agents/{id}/generate, GET /v1/agents/{id}/history, POST /v1/agents/{id}/fork.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import falcon
from pydantic import BaseModel, ConfigDict, Field

from app.agents.identity import AgentKey
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.cache_provenance import provenance
from app.api.generation import GenerationResource
from app.errors import InvalidRequest, SemanticError
from app.protocol import anthropic, direct
from app.protocol.validation import validate
from app.store.agents import AgentView
from app.store.cache_index import tier_of
from app.store.history import new_conversation_id
from app.types import MAX_TTL_SECONDS, SESSION_ID_PATTERN, Finished, GenerationRequest, Prompt, SamplingParams

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface

log = logging.getLogger(__name__)


class CreateAgent(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    system_prompt: str | None = None
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_SECONDS)
    metadata: dict[str, Any] = Field(default_factory=dict)
    prefill: bool = True  # compute the system prompt's cache now, so the first turn is warm


class ForkAgent(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    at_turn: int | None = Field(default=None, ge=0)  # replies kept (None: the whole conversation)
    metadata: dict[str, Any] = Field(default_factory=dict)


def _caches(stored: tuple[tuple[str, int, str], ...], hot_tokens: int | None, fingerprint: str,
            names: Mapping[str, str]) -> list[dict]:
    """A conversation's caches per model; the served model's is hot when ``hot_tokens`` is set.
    ``names``: model name by fingerprint, where this server knows it (else ``model`` is null)."""
    caches = [{"model_fingerprint": fp, "model": names.get(fp), "cached_tokens": n, "tier": t} for fp, n, t in stored
              if hot_tokens is None or fp != fingerprint]
    if hot_tokens is not None:
        caches.insert(0, {"model_fingerprint": fingerprint, "model": names.get(fingerprint),
                          "cached_tokens": hot_tokens, "tier": "hot"})
    return caches


def _tier(caches: list[dict]) -> str:
    tiers = [c["tier"] for c in caches]
    return tier_of("hot" in tiers, tiers)


def render_agent(agent: AgentView, hot: Mapping[str, int], fingerprint: str,
                 names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An agent's status; ``hot`` maps its conversations in memory to their cached tokens,
    ``names`` model fingerprints to model names."""
    conversations: list[dict[str, Any]] = []
    for conversation in agent.conversations:
        caches = _caches(conversation.caches, hot.get(conversation.id), fingerprint, names or {})
        hit = conversation.last_hit
        conversations.append({"id": conversation.id, "n_messages": conversation.n_messages, "tier": _tier(caches),
                              "created_at": conversation.created_at.isoformat() + "Z",
                              "last_access_at": conversation.last_access_at.isoformat() + "Z", "caches": caches,
                              "last_hit": None if hit is None else {
                                  "at": hit.at.isoformat() + "Z", "cached_tokens": hit.cached_tokens,
                                  "input_tokens": hit.input_tokens}})
    all_caches = [c for conversation in conversations for c in conversation["caches"]]
    return {
        "id": agent.id, "type": "agent", "origin": agent.origin, "parent_id": agent.parent_id,
        "status": agent.status, "tier": _tier(all_caches),
        "created_at": agent.created_at.isoformat() + "Z", "last_access_at": agent.last_access_at.isoformat() + "Z",
        "ttl_seconds": agent.ttl_seconds, "hot_ttl_seconds": agent.hot_ttl_seconds, "metadata": agent.metadata,
        "n_messages": agent.n_messages, "conversations": conversations,
        # Cached tokens of the agent's most recently used conversation that has a cache.
        "caches": next((c["caches"] for c in conversations if c["caches"]), []),
    }


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object", "body")
    return body


class _AgentsBase:
    def __init__(self, agents: AgentService, engine: EngineSurface) -> None:
        self._agents = agents
        self._engine = engine

    def _render(self, agent: AgentView) -> dict[str, Any]:
        return render_agent(agent, self._engine.hot_tokens(agent.id), self._engine.model.fingerprint,
                            self._engine.model_names())

    @contextmanager
    def _undone_on_failure(self, agent_id: str) -> Iterator[None]:
        """Delete the agent just written (rows, and any cache the engine made for it) when the
        engine refuses or fails what follows: a refused request (429; 400 for one that can never
        fit) changes no row, so the client's retry creates it instead of finding it taken."""
        try:
            yield
        except BaseException:
            try:
                self._engine.forget_agent(agent_id)
            except SemanticError as exc:  # the engine is gone: it holds no cache of the agent either
                log.warning("agent %s: its caches were not forgotten (%s)", agent_id, exc)
            self._agents.delete(agent_id)
            log.info("agent %s: not created, the engine refused or failed its first step", agent_id)
            raise


class AgentsResource(_AgentsBase):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = _object(read_json(req)) if req.content_length else {}
        create = validate(CreateAgent, body)
        metadata = {**create.metadata, **({"system_prompt": create.system_prompt} if create.system_prompt else {})}
        agent_id = create.id or f"agent-{uuid.uuid4().hex}"
        start = self._engine.render_start(create.system_prompt) if create.system_prompt and create.prefill else None
        if start is not None:
            self._engine.check_fits(start)
        # The first conversation, empty: its cache is the prefilled start every first turn extends.
        conversation = new_conversation_id()
        system_digest = anthropic.system_digest(create.system_prompt or "")
        self._agents.create(agent_id, metadata, create.ttl_seconds, (conversation, system_digest))
        if start is not None:
            with self._undone_on_failure(agent_id):
                self._prefill(agent_id, conversation, start)
        resp.status = falcon.HTTP_201
        resp.media = self._render(self._agents.get(agent_id))

    def _prefill(self, agent_id: str, conversation_id: str, start: Prompt) -> None:
        """Prefill what every conversation of this agent starts with, and wait for it."""
        job = self._engine.submit(GenerationRequest(f"prefill-{agent_id}", start, SamplingParams(max_tokens=0),
                                                    agent_id, conversation_id))
        for event in job.events():
            if isinstance(event, Finished):
                log.info("agent %s: system prompt prefilled (%d tokens, %.2f s)", agent_id,
                         event.n_prompt_tokens, event.total_s)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        limit = req.get_param_as_int("limit", min_value=1, max_value=1000, default=100)
        offset = req.get_param_as_int("offset", min_value=0, default=0)
        resp.media = {"object": "list", "data": [self._render(a) for a in self._agents.list(limit, offset)]}


class AgentResource(_AgentsBase):
    def on_get(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        resp.media = self._render(self._agents.get(agent_id))

    def on_delete(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        self._agents.get(agent_id)
        self._engine.forget_agent(agent_id)
        self._agents.delete(agent_id)
        resp.status = falcon.HTTP_204


class AgentForkResource(_AgentsBase):
    """A new agent that continues another's most recent conversation, warm from its first turn:
    the history up to the fork point is copied, the cache's blocks are shared by reference."""

    def on_post(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        fork = validate(ForkAgent, _object(read_json(req)) if req.content_length else {})
        new_id = fork.id or f"agent-{uuid.uuid4().hex}"
        copied = self._agents.fork(agent_id, new_id, fork.metadata, fork.at_turn)
        if copied is None:
            done = True
        else:
            with self._undone_on_failure(new_id):
                done = self._engine.fork_cache(copied.source_conversation, new_id, copied.conversation_id,
                                               copied.point)
        if not done:
            log.warning("agent %s: the fork's cache copy did not finish in time; its first turn may be cold", new_id)
        resp.status = falcon.HTTP_201
        resp.media = self._render(self._agents.get(new_id))


class AgentHistoryResource:
    def __init__(self, agents: AgentService) -> None:
        self._agents = agents

    def on_get(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        resp.media = {"agent_id": agent_id, "messages": self._agents.history(agent_id)}


class AgentGenerateResource:
    """Appends the new messages to the stored history, generates, stores the reply; with
    ``"new_conversation": true`` the messages start a new conversation of the agent instead."""

    def __init__(self, agents: AgentService, generation: GenerationResource, default_max_tokens: int) -> None:
        self._agents = agents
        self._generation = generation
        self._default_max_tokens = default_max_tokens

    def on_post(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        agent = self._agents.get(agent_id)

        def full_body() -> dict[str, Any]:
            new = _object(read_json(req))
            history: list[dict[str, Any]] = []
            if not direct.starts_conversation(new):  # continue the latest conversation: its stored turns come first
                direct.refuse_foreign(agent_id, self._agents.latest_protocols(agent_id))
                history = direct.replay((m["role"], m["content"])
                                        for m in self._agents.history(agent_id, latest_only=True))
            return direct.request_body(new, history, agent.metadata.get("system_prompt"), self._default_max_tokens)

        reuse = self._generation.respond(req, resp, full_body, AgentKey(agent_id, "direct"))
        if reuse is not None and isinstance(resp.media, dict):  # a stream has the header alone
            resp.media = {**resp.media, "cache": provenance(reuse)}
