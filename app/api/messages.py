"""POST /v1/messages (Claude Code's endpoint) and /v1/messages/count_tokens."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import falcon

from app.agents.identity import AgentKey, anthropic_agent
from app.api.body import read_json
from app.api.generation import Dialect, parse_for_model, render_turn
from app.api.sse import Frames, frame, keep_alive
from app.protocol import anthropic
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.types import GenerationEvent, Heartbeat, RequestOptions

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return anthropic_agent(headers, parsed.session_id)


def _stream(message_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Frames:
    heartbeats: list[Heartbeat] = []  # the one a ping answers (the renderer pulls it just before)

    def seen() -> Iterator[GenerationEvent]:
        for event in events:
            if isinstance(event, Heartbeat):
                heartbeats.append(event)
            yield event

    for item in anthropic.render_events(message_id, parsed, seen()):
        if isinstance(item, Reply):
            yield item
            continue
        name, data = item
        if name == "ping" and heartbeats:
            heartbeat = heartbeats.pop()
            if heartbeat.n_prompt:  # the prefill's progress, as a comment beside the protocol's ping
                yield keep_alive(heartbeat)
        yield frame(name, data)


ANTHROPIC = Dialect(
    parse=anthropic.parse_request,
    named_agent=_named_agent,
    new_id=anthropic.new_message_id,
    whole_reply=anthropic.whole_reply,
    message_digest=anthropic.message_digest,
    render_stream=_stream,
    render_stream_error=lambda status, message: frame("error", anthropic.render_error(status, message)),
    error_types=anthropic.ERROR_TYPES,
)


class CountTokensResource:
    """The exact number of tokens the messages endpoint would prefill cold."""

    def __init__(self, engine: EngineSurface, defaults: RequestOptions) -> None:
        self._engine = engine
        self._defaults = defaults

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req)
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}  # not required here
        parsed, model, _ = parse_for_model(anthropic.parse_request, body, self._defaults, self._engine)
        resp.media = {"input_tokens": render_turn(self._engine, parsed, model).n_tokens}
