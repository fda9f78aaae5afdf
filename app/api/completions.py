"""POST /v1/completions: OpenAI's (legacy) completions, a raw prompt continued."""

from __future__ import annotations

from collections.abc import Iterator

from app.api.chat import OPENAI
from app.api.generation import Dialect
from app.api.sse import Frames, frame, keep_alive
from app.protocol import completions, openai
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.types import GenerationEvent, Heartbeat


def _stream(completion_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Frames:
    for chunk in completions.render_chunks(completion_id, parsed, events):
        if isinstance(chunk, Reply):
            yield chunk
        else:
            yield keep_alive(chunk) if isinstance(chunk, Heartbeat) else frame(None, chunk)


COMPLETIONS = Dialect(
    parse=completions.parse_request,
    named_agent=OPENAI.named_agent,  # the chat API's identity rule (session_id, X-Session-ID)
    new_id=completions.new_completion_id,
    whole_reply=completions.whole_reply,
    message_digest=completions.message_digest,
    render_stream=_stream,
    render_stream_error=lambda status, message: frame(None, openai.render_error(status, message)),
    error_types=openai.ERROR_TYPES,
)
