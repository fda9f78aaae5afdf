"""POST /v1/chat/completions: the OpenAI-compatible API."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from app.agents.identity import AgentKey, openai_agent
from app.api.generation import Dialect
from app.api.sse import Frames, frame, keep_alive
from app.protocol import openai
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.types import GenerationEvent, Heartbeat


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return openai_agent(headers, parsed.session_id)


def _stream(completion_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Frames:
    for chunk in openai.render_chunks(completion_id, parsed, events):
        if isinstance(chunk, Reply):
            yield chunk
        else:
            yield keep_alive(chunk) if isinstance(chunk, Heartbeat) else frame(None, chunk)


OPENAI = Dialect(
    parse=openai.parse_request,
    named_agent=_named_agent,
    new_id=openai.new_completion_id,
    whole_reply=openai.whole_reply,
    message_digest=openai.message_digest,
    render_stream=_stream,
    render_stream_error=lambda status, message: frame(None, openai.render_error(status, message)),
    error_types=openai.ERROR_TYPES,
)
