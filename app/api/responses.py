"""POST /v1/responses (the OpenAI Responses API: Codex's endpoint), GET and DELETE /v1/responses/{id}.

Generation is the shared lifecycle (``app.api.generation``) with the Responses dialect.
``previous_response_id`` is resolved here, before it: the stored response's history
(its conversation's messages up to its output) goes in front of the new input, and the
request belongs to that response's agent and thread, so the conversation and its cache
continue as if the client had resent everything.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import falcon

from app.agents.identity import AgentKey, responses_agent
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.generation import Dialect, GenerationResource
from app.api.sse import frame
from app.errors import InvalidRequest
from app.protocol import responses, responses_output
from app.protocol.turn import ParsedTurn
from app.types import GenerationEvent


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return responses_agent(headers)


def _stream(response_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Iterator[bytes]:
    for event in responses_output.render_events(response_id, parsed, events):
        yield frame(event["type"], event)


RESPONSES = Dialect(
    parse=responses.parse_request,
    named_agent=_named_agent,
    new_id=responses_output.new_response_id,
    render_message=responses_output.render_response,
    reply_messages=responses_output.history_items,
    message_digest=responses.item_digest,
    render_stream=_stream,
    render_stream_error=None,  # response.failed carries the response: render_events sends it
    error_types={400: "invalid_request_error", 429: "rate_limit_exceeded", 529: "server_error",
                 500: "server_error", 503: "server_error"},
    history_entry=responses_output.history_entry,
    stored_response=responses_output.stored_response,
)


class ResponsesResource:
    """POST /v1/responses."""

    def __init__(self, agents: AgentService, generation: GenerationResource) -> None:
        self._agents = agents
        self._generation = generation

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        continued: list[AgentKey] = []  # the agent of previous_response_id, once the body named one

        def body() -> Any:
            received = read_json(req)
            previous = received.get("previous_response_id") if isinstance(received, dict) else None
            if previous is None:
                return received
            if not isinstance(previous, str):
                raise InvalidRequest("previous_response_id: Input should be a valid string", "previous_response_id")
            point = self._agents.response_point(previous)
            new = received.get("input", "")
            if isinstance(new, str):
                new = [{"role": "user", "content": new}] if new else []
            elif not isinstance(new, list):
                raise InvalidRequest("input: Input should be a valid string or list", "input")
            named = responses_agent(req.headers)
            continued.append(AgentKey(point.agent_id, "responses", named.thread if named else point.thread))
            return {**received, "input": [*point.items, *new]}

        self._generation.respond(req, resp, body, lambda: continued[0] if continued else None)


class ResponseResource:
    """GET and DELETE /v1/responses/{response_id}: stored responses (``store``)."""

    def __init__(self, agents: AgentService) -> None:
        self._agents = agents

    def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        resp.media = self._agents.response(response_id)

    def on_delete(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        self._agents.delete_response(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}
