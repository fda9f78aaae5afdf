"""OpenAI chat completions: parse requests, render responses, chunks and errors. Pure.

Extensions (SPEC): ``session_id`` names the agent (also the ``X-Session-ID``
header); ``cache_mode`` and ``ttl`` are accepted (recorded by later versions).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import InvalidRequest
from app.protocol.turn import ParsedTurn
from app.protocol.validation import first_error
from app.types import ChatMessage, Finished, SamplingParams, Started, TextDelta


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatBody(_Strict):
    model: str = Field(min_length=1)
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    session_id: str | None = None


def parse_request(body: Any, *, max_output_tokens: int, default_temperature: float = 1.0) -> ParsedTurn:
    """Validate a decoded JSON body.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    if isinstance(body, dict) and body.get("tools"):
        raise InvalidRequest("tools: tool calling is not supported by this server yet", "tools")
    try:
        parsed = ChatBody.model_validate(body)
    except ValidationError as exc:
        where, message = first_error(exc, body)
        raise InvalidRequest(f"{where}: {message}", where) from None
    limit = parsed.max_completion_tokens or parsed.max_tokens or max_output_tokens
    if limit > max_output_tokens:
        raise InvalidRequest(f"max_tokens: {limit} > {max_output_tokens}, the maximum allowed", "max_tokens")
    messages = tuple(
        ChatMessage("system" if m.role == "developer" else m.role,
                    m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content))
        for m in parsed.messages
    )
    stops = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    sampling = SamplingParams(
        temperature=default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        max_tokens=limit, stop_sequences=stops,
    )
    return ParsedTurn(parsed.model, messages, sampling, parsed.stream, parsed.session_id,
                      tuple(body["messages"]),
                      include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage))


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "cancelled": "stop"}


def usage(finished: Finished) -> dict[str, Any]:
    return {"prompt_tokens": finished.n_prompt_tokens, "completion_tokens": finished.n_output_tokens,
            "total_tokens": finished.n_prompt_tokens + finished.n_output_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.n_cached_tokens}}


def render_message(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": parsed.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": FINISH_REASONS[finished.stop_reason], "logprobs": None}],
        "usage": usage(finished),
    }


def render_chunks(completion_id: str, model: str, include_usage: bool,
                  events: Iterator[Started | TextDelta | Finished]) -> Iterator[dict[str, Any] | str]:
    """Engine events -> ``chat.completion.chunk`` objects, then the ``[DONE]`` marker."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    for event in events:
        if isinstance(event, Started):
            yield chunk({"role": "assistant", "content": ""}, None)
        elif isinstance(event, TextDelta):
            yield chunk({"content": event.text}, None)
        else:
            yield chunk({}, FINISH_REASONS[event.stop_reason])
            if include_usage:
                yield {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(event)}
    yield "[DONE]"


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 429: "rate_limit_exceeded"}


def render_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": ERROR_CODES.get(status)}}
