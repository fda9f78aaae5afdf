"""POST /v1/responses (the OpenAI Responses API: Codex's endpoint), GET and DELETE /v1/responses/{id}.

GET /v1/responses upgrades to the WebSocket transport (``app.api.responses_socket``): each
``response.create`` message is served by ``ResponsesResource.respond`` as a POST would be.

Generation is the shared lifecycle (``app.api.generation``) with the Responses dialect.
``previous_response_id`` is resolved before it (``app.protocol.responses.continue_from``):
the stored response's history (its conversation's messages up to its output) goes in front
of the new input, and the request belongs to that response's agent and thread
(``response_agent``), so the conversation and its cache continue as if the client had
resent everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import falcon

from app.agents.identity import AgentKey, responses_agent
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.generation import Dialect, GenerationResource
from app.api.sse import Frames, frame, framed
from app.protocol import responses, responses_output
from app.protocol.turn import ParsedTurn
from app.store.responses import ResponsePoint
from app.types import GenerationEvent


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return responses_agent(headers)


def _stream(response_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Frames:
    return framed(responses_output.render_events(response_id, parsed, events), lambda e: frame(e["type"], e))


RESPONSES = Dialect(
    parse=responses.parse_request,
    named_agent=_named_agent,
    new_id=responses_output.new_response_id,
    whole_reply=responses_output.whole_reply,
    message_digest=responses.item_digest,
    render_stream=_stream,
    render_stream_error=None,  # response.failed carries the response: render_events sends it
    error_types={400: "invalid_request_error", 429: "rate_limit_exceeded", 529: "server_error",
                 500: "server_error", 503: "server_error"},
    history_entry=responses_output.history_entry,
)


PointLookup = Callable[[str], ResponsePoint]  # a response id -> the history it continues; raises NotFound


def response_agent(headers: Mapping[str, str], point: ResponsePoint | None) -> AgentKey | None:
    """The agent and thread a Responses API request belongs to, in this order: the agent of
    the response it continues (``point``), in the thread the request names, else that
    response's; the agent its headers name (``responses_agent``); None: the agent service
    finds its conversation by content."""
    named = responses_agent(headers)
    # A warm-up's point (WebSocket) may have no agent: the request's own headers or content find it.
    if point is not None and point.agent_id:
        return AgentKey(point.agent_id, "responses", named.thread if named else point.thread)
    return named


def continued(received: Any, headers: Mapping[str, str], lookup: PointLookup) -> tuple[Any, AgentKey | None]:
    """A decoded request body with ``previous_response_id``'s history (``lookup``) in front of
    its input, and the agent and thread it belongs to (``response_agent``).

    Raises:
        InvalidRequest, NotFound.
    """
    body, point = responses.continue_from(received, lookup)
    return body, response_agent(headers, point)


class ResponsesResource:
    """POST /v1/responses; GET /v1/responses with a WebSocket upgrade (``responses_socket``)."""

    def __init__(self, agents: AgentService, generation: GenerationResource,
                 upgrade: Callable[[falcon.Request, falcon.Response, ResponsesResource], None]) -> None:
        self._agents = agents
        self._generation = generation
        self._upgrade = upgrade

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(req, resp, self._generation, self._agents.response_point, lambda: read_json(req))

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._upgrade(req, resp, self)

    def respond(self, req: falcon.Request, resp: falcon.Response, generation: GenerationResource,
                lookup: PointLookup, read: Callable[[], Any]) -> tuple[Any, AgentKey | None]:
        """Serve the body ``read()`` returns with ``generation``, ``previous_response_id``
        resolved by ``lookup``. Returns the body as generated (its input with the history in
        front) and the agent it continued (None: its own)."""
        resolved: list[tuple[Any, AgentKey | None]] = []

        def body() -> Any:
            resolved.append(continued(read(), req.headers, lookup))
            return resolved[0][0]

        generation.respond(req, resp, body, lambda: resolved[0][1] if resolved else None)
        return resolved[0]


class ResponseResource:
    """GET and DELETE /v1/responses/{response_id}: stored responses (``store``)."""

    def __init__(self, agents: AgentService) -> None:
        self._agents = agents

    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        resp.media = self._agents.response(response_id)

    def on_delete(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        self._agents.delete_response(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}
