"""The direct, stateful agent API: the server keeps history, clients send only new messages.

POST /v1/agents, GET /v1/agents, GET|DELETE /v1/agents/{id},
POST /v1/agents/{id}/generate, GET /v1/agents/{id}/history.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import falcon

from app.agents.identity import AgentKey
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.generation import GenerationResource
from app.errors import InvalidRequest
from app.store.agents import AgentView

if TYPE_CHECKING:
    from app.engine.engine import Engine

SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "metadata")
DEFAULT_MAX_TOKENS = 1024


def render_agent(agent: AgentView, hot: bool) -> dict[str, Any]:
    tier = "hot" if hot else ("warm" if any(tier != "cold" for _, _, tier in agent.caches) else "cold")
    return {
        "id": agent.id, "type": "agent", "origin": agent.origin, "status": agent.status, "tier": tier,
        "created_at": agent.created_at.isoformat() + "Z", "last_access_at": agent.last_access_at.isoformat() + "Z",
        "ttl_seconds": agent.ttl_seconds, "metadata": agent.metadata, "n_messages": agent.n_messages,
        "caches": [{"model_fingerprint": fp, "cached_tokens": n, "tier": t} for fp, n, t in agent.caches],
    }


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object", "body")
    return body


class _AgentsBase:
    def __init__(self, agents: AgentService, engine: Engine) -> None:
        self._agents = agents
        self._engine = engine

    def _is_hot(self, agent_id: str) -> bool:
        return self._engine.caches.record(agent_id) is not None


class AgentsResource(_AgentsBase):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = _object(read_json(req)) if req.content_length else {}
        agent_id = body.get("id") or f"agent-{uuid.uuid4().hex}"
        system = body.get("system_prompt")
        ttl = body.get("ttl_seconds")
        if not isinstance(agent_id, str) or (system is not None and not isinstance(system, str)):
            raise InvalidRequest("id and system_prompt must be strings", "id")
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0):
            raise InvalidRequest("ttl_seconds: must be a positive integer", "ttl_seconds")
        metadata = {**(body.get("metadata") or {}), **({"system_prompt": system} if system else {})}
        resp.status = falcon.HTTP_201
        resp.media = render_agent(self._agents.create(agent_id, metadata, ttl), hot=False)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        limit = req.get_param_as_int("limit", min_value=1, max_value=1000, default=100)
        offset = req.get_param_as_int("offset", min_value=0, default=0)
        resp.media = {"object": "list", "data": [render_agent(a, self._is_hot(a.id))
                                                 for a in self._agents.list(limit, offset)]}


class AgentResource(_AgentsBase):
    def on_get(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        resp.media = render_agent(self._agents.get(agent_id), self._is_hot(agent_id))

    def on_delete(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        self._agents.get(agent_id)
        self._engine.forget_agent(agent_id)
        self._agents.delete(agent_id)
        resp.status = falcon.HTTP_204


class AgentHistoryResource:
    def __init__(self, agents: AgentService) -> None:
        self._agents = agents

    def on_get(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        resp.media = {"agent_id": agent_id, "messages": self._agents.history(agent_id)}


class AgentGenerateResource:
    """Appends the new messages to the stored history, generates, stores the reply."""

    def __init__(self, agents: AgentService, generation: GenerationResource) -> None:
        self._agents = agents
        self._generation = generation

    def on_post(self, req: falcon.Request, resp: falcon.Response, agent_id: str) -> None:
        agent = self._agents.get(agent_id)

        def full_body() -> dict[str, Any]:
            new = _object(read_json(req))
            if not isinstance(new.get("messages"), list) or not new["messages"]:
                raise InvalidRequest("messages: a non-empty list of the new messages is required", "messages")
            history = [{"role": m["role"], "content": m["content"]} for m in self._agents.history(agent_id)]
            body = {k: new[k] for k in SAMPLING_FIELDS if k in new}
            body.setdefault("model", "default")
            body.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
            if agent.metadata.get("system_prompt"):
                body["system"] = agent.metadata["system_prompt"]
            body["messages"] = history + new["messages"]
            return body

        self._generation.respond(req, resp, full_body, AgentKey(agent_id, "direct"))
