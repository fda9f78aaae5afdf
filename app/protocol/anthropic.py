"""Anthropic Messages API: parse requests, render responses, events and errors. Pure.

Request validation follows the real API: unknown fields are ignored, wrong
types and missing fields are a 400 ``invalid_request_error`` whose message
names the field (``messages.0.content: Field required``).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import InvalidRequest
from app.protocol.turn import ParsedTurn
from app.protocol.validation import first_error
from app.types import ChatMessage, Finished, SamplingParams, Started, TextDelta

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any]


class UnsupportedBlock(_Strict):
    """Block types this server version does not render yet."""

    type: Literal["tool_use", "tool_result", "thinking", "redacted_thinking", "document"]


Block = Annotated[Union[TextBlock, ImageBlock, UnsupportedBlock], Field(discriminator="type")]


class MessageIn(_Strict):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class Metadata(_Strict):
    user_id: str | None = None


class MessagesBody(_Strict):
    model: str = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] = Field(default_factory=list)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None


def _flatten(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(content):
        if isinstance(block, ImageBlock):
            raise InvalidRequest(
                f"{where}.{i}: image content is not supported: the served model is text-only",
                f"{where}.{i}",
            )
        if isinstance(block, UnsupportedBlock):
            raise InvalidRequest(
                f"{where}.{i}.type: '{block.type}' blocks are not supported by this server yet",
                f"{where}.{i}.type",
            )
        parts.append(block.text)
    return "\n".join(parts)


BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


def _drop_billing_header(blocks: list[TextBlock]) -> list[TextBlock]:
    """Claude Code's first system block is billing metadata whose hash part differs
    per session; keeping it would defeat prefix reuse across sessions."""
    kept = [b for b in blocks if not b.text.startswith(BILLING_HEADER_PREFIX)]
    if len(kept) != len(blocks):
        log.info("dropped %d x-anthropic-billing-header system block(s) from the prompt", len(blocks) - len(kept))
    return kept


def session_from_user_id(user_id: str | None) -> str | None:
    """Claude Code sends ``metadata.user_id`` as a JSON string with a ``session_id``."""
    if not user_id:
        return None
    try:
        data = json.loads(user_id)
    except ValueError:
        return None
    session = data.get("session_id") if isinstance(data, dict) else None
    return session if isinstance(session, str) and session else None


def parse_request(body: Any, *, max_output_tokens: int) -> ParsedTurn:
    """Validate a decoded JSON body.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    try:
        parsed = MessagesBody.model_validate(body)
    except ValidationError as exc:
        where, message = first_error(exc, body)
        raise InvalidRequest(f"{where}: {message}", where) from None
    if parsed.max_tokens > max_output_tokens:
        raise InvalidRequest(
            f"max_tokens: {parsed.max_tokens} > {max_output_tokens}, the maximum allowed "
            "number of output tokens", "max_tokens",
        )
    messages: list[ChatMessage] = []
    system = parsed.system if isinstance(parsed.system, str) else _drop_billing_header(parsed.system or [])
    if system:
        messages.append(ChatMessage("system", _flatten(system, "system")))
    for i, message in enumerate(parsed.messages):
        messages.append(ChatMessage(message.role, _flatten(message.content, f"messages.{i}.content")))
    sampling = SamplingParams(
        temperature=1.0 if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=parsed.top_k or 0,
        max_tokens=parsed.max_tokens,
        stop_sequences=tuple(parsed.stop_sequences),
    )
    return ParsedTurn(
        model=parsed.model,
        messages=tuple(messages),
        sampling=sampling,
        stream=parsed.stream,
        session_id=session_from_user_id(parsed.metadata.user_id if parsed.metadata else None),
        raw_messages=tuple(body["messages"]),
    )


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(n_prompt: int, n_cached: int, n_written: int, n_output: int | None) -> dict[str, int]:
    """Anthropic usage: input + cache_read + cache_creation = the whole prompt.

    Tokens reused from the agent's cache are ``cache_read``; prompt tokens
    prefilled now and kept for the next turn are ``cache_creation``; the rest
    (caching off) are plain ``input_tokens``.
    """
    result = {
        "input_tokens": n_prompt - n_cached - n_written,
        "cache_creation_input_tokens": n_written,
        "cache_read_input_tokens": n_cached,
    }
    if n_output is not None:
        result["output_tokens"] = n_output
    return result


def _stop_reason(finished: Finished) -> str:
    return "end_turn" if finished.stop_reason == "cancelled" else finished.stop_reason


def render_message(message_id: str, model: str, text: str, finished: Finished) -> dict[str, Any]:
    """The non-streaming response body."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": _stop_reason(finished),
        "stop_sequence": finished.stop_sequence,
        "usage": usage(finished.n_prompt_tokens, finished.n_cached_tokens, finished.n_cache_written,
                       finished.n_output_tokens),
    }


def render_events(message_id: str, model: str,
                  events: Iterator[Started | TextDelta | Finished]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Engine events -> (event name, data) pairs of Anthropic's SSE stream."""
    for event in events:
        if isinstance(event, Started):
            yield "message_start", {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(event.n_prompt_tokens, event.n_cached_tokens, event.n_cache_written, 1),
            }}
            yield "content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}
            yield "ping", {"type": "ping"}
        elif isinstance(event, TextDelta):
            yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": event.text}}
        else:
            yield "content_block_stop", {"type": "content_block_stop", "index": 0}
            yield "message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence},
                "usage": usage(event.n_prompt_tokens, event.n_cached_tokens, event.n_cache_written,
                               event.n_output_tokens),
            }
            yield "message_stop", {"type": "message_stop"}


ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 503: "api_error", 529: "overloaded_error",
}


def render_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
