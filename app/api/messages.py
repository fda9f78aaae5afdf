"""POST /v1/messages: the Anthropic Messages API (Claude Code's endpoint)."""

from __future__ import annotations

from typing import Iterator, Mapping

from app.agents.identity import AgentKey, anthropic_agent
from app.api.generation import Dialect
from app.api.sse import frame
from app.protocol import anthropic
from app.protocol.turn import ParsedTurn
from app.types import GenerationEvent


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return anthropic_agent(headers, parsed.session_id)


def _stream(message_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Iterator[bytes]:
    for name, data in anthropic.render_events(message_id, parsed.model, events):
        yield frame(name, data)


ANTHROPIC = Dialect(
    name="anthropic",
    parse=anthropic.parse_request,
    named_agent=_named_agent,
    new_id=anthropic.new_message_id,
    render_message=anthropic.render_message,
    render_stream=_stream,
    render_stream_error=lambda status, message: frame("error", anthropic.render_error(status, message)),
    error_types=anthropic.ERROR_TYPES,
)
