"""OpenAI chat completions: parse requests, render responses, chunks and errors. Pure.

Tools use the generic text format of ``app.protocol.tools``: ``tools`` are
described in the system prompt, assistant ``tool_calls`` and ``tool`` role
results are rendered back as the same text, and calls in the reply come back
as ``tool_calls`` (finish_reason ``tool_calls``). A model with its own tool
format (``app.protocol.tool_format``) gets the tools, calls and ``tool``
messages as they are, for its chat template to write.

Extensions (SPEC): ``session_id`` names the agent (also the ``X-Session-ID``
header); ``cache_mode`` ``"full"`` (default) reuses everything the conversation's
cache shares with the prompt, ``"prefix"`` only whole shared blocks; ``ttl``
is how many seconds the agent's conversation caches are kept (recorded on the agent), 0
keeps this turn's cache off disk; ``speculate`` false turns off speculative decoding
(prompt-lookup drafts, on by default for greedy requests) for this request.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Annotated, Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest
from app.protocol import tool_format, tools
from app.protocol.reply import ReplyParser, parse_reply
from app.protocol.turn import CacheMode, ParsedTurn, content_digest
from app.protocol.validation import ModelName, validate
from app.types import (MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TTL_SECONDS, ChatMessage, Finished, Heartbeat,
                       RequestOptions, SamplingParams, Started, TextDelta, ToolCall, ToolSyntax)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(_Strict):
    """Image, audio and file parts: valid OpenAI input the text-only models cannot read."""

    type: Literal["image_url", "input_audio", "file"]


Content = Union[str, list[Annotated[Union[TextPart, MediaPart], Field(discriminator="type")]]]


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


MessageIn = Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage]


class _OneMessage(_Strict):
    message: Annotated[MessageIn, Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatBody(_Strict):
    model: ModelName
    messages: list[Annotated[MessageIn, Field(discriminator="role")]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], None] = Field(default=None,
                                                                                     max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    session_id: str | None = None
    cache_mode: CacheMode = "full"
    ttl: int | None = Field(default=None, ge=0, le=MAX_TTL_SECONDS)
    speculate: bool = True


def _text(content: Content | None, where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content or []):
        if isinstance(part, MediaPart):
            raise InvalidRequest(f"{where}.{j}: {part.type} content is not supported: the served model is text-only",
                                 f"{where}.{j}")
    return "\n".join(p.text for p in content or [] if isinstance(p, TextPart))


def _arguments(call: ToolCallIn, where: str) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequest(f"{where}.function.arguments: not valid JSON", f"{where}.function.arguments") from None


def _rendered(message: MessageIn, where: str) -> ChatMessage:
    """One message as the template sees it, on its own (tool results as the user's side)."""
    if isinstance(message, AssistantMessage):
        calls = [tools.render_call(c.function.name, _arguments(c, f"{where}.tool_calls.{j}"))
                 for j, c in enumerate(message.tool_calls or [])]
        return ChatMessage("assistant", "\n".join(p for p in (_text(message.content, f"{where}.content"), *calls) if p))
    if isinstance(message, SystemMessage):
        return ChatMessage("system", _text(message.content, f"{where}.content"))
    text = _text(message.content, f"{where}.content")
    return ChatMessage("user", tools.render_result(text, False) if isinstance(message, ToolMessage) else text)


def _for_template(message: MessageIn, one: ChatMessage, where: str, syntax: ToolSyntax) -> ChatMessage:
    """One message as a template that writes tool calls itself sees it (``one``: as the
    generic format renders it, which checked it)."""
    if isinstance(message, AssistantMessage) and message.tool_calls:
        calls = tuple(ToolCall(c.function.name, tool_format.as_arguments(_arguments(c, f"{where}.tool_calls.{j}")),
                               c.id) for j, c in enumerate(message.tool_calls))
        return ChatMessage("assistant", _text(message.content, f"{where}.content"), calls)
    if isinstance(message, ToolMessage):
        text = tool_format.result_text(_text(message.content, f"{where}.content"), False, syntax)
        return ChatMessage("tool", text, tool_call_id=message.tool_call_id)
    return one


def _chat_messages(messages: list[MessageIn], rendered: list[ChatMessage]) -> list[ChatMessage]:
    """What the chat template sees. Tool results are the user's side of the
    conversation: consecutive ones, and a user message right after them, are one turn."""
    out: list[ChatMessage] = []
    results_open = False
    for message, one in zip(messages, rendered):
        if results_open and one.role == "user":
            out[-1] = ChatMessage("user", f"{out[-1].content}\n{one.content}")
        else:
            out.append(one)
        results_open = isinstance(message, ToolMessage)
    return out


def message_digest(message: dict[str, Any]) -> str:
    """The digest of a message in its request shape (also a reply as history keeps it)."""
    one = _rendered(validate(_OneMessage, {"message": message}).message, "message")
    return content_digest(one.role, one.content)


def _tool_setup(parsed: ChatBody, syntax: ToolSyntax | None) -> tuple[str, str]:
    """(the tools in the generic format's system prompt section, the forced start of the reply)."""
    choice = parsed.tool_choice or "auto"
    if not parsed.tools or choice == "none":
        if choice not in ("auto", "none"):
            raise InvalidRequest("tool_choice: requires tools", "tool_choice")
        return "", ""
    offered = [{"name": t.function.name, "description": t.function.description,
                "input_schema": t.function.parameters} for t in parsed.tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t["name"] for t in offered}:
            raise InvalidRequest(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
                                 "tool_choice.function.name")
        forced = tool_format.forced_start(syntax, choice.function.name)
    else:
        forced = tool_format.forced_start(syntax, None) if choice == "required" else ""
    return tools.render_tools_system(offered), forced


def parse_request(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate a decoded JSON body. Without ``max_tokens`` (or ``max_completion_tokens``)
    the reply is bounded by ``options.default_max_tokens``, as ``mlx_lm.server`` does.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(ChatBody, body)
    limit = parsed.max_completion_tokens or parsed.max_tokens or options.default_max_tokens
    if limit > options.max_output_tokens:
        raise InvalidRequest(f"max_tokens: {limit} > {options.max_output_tokens}, the maximum allowed", "max_tokens")
    syntax = options.tool_syntax
    rendered = [_rendered(m, f"messages.{i}") for i, m in enumerate(parsed.messages)]
    tools_system, forced = _tool_setup(parsed, syntax)
    if syntax is None:
        messages = _chat_messages(parsed.messages, rendered)
        if tools_system:
            if messages[0].role == "system":
                messages[0] = ChatMessage("system", f"{messages[0].content}\n\n{tools_system}")
            else:
                messages.insert(0, ChatMessage("system", tools_system))
    else:
        messages = [_for_template(m, one, f"messages.{i}", syntax)
                    for i, (m, one) in enumerate(zip(parsed.messages, rendered))]
    stops = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    sampling = SamplingParams(
        temperature=options.default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        max_tokens=limit, stop_sequences=stops,
        end_after=tool_format.end_markers(syntax) if tools_system else (),
        speculate=parsed.speculate,
    )
    specs = tuple(t.model_dump() for t in parsed.tools or ()) if tools_system and syntax is not None else ()
    return ParsedTurn(parsed.model, tuple(messages), sampling, parsed.stream, parsed.session_id,
                      tuple(body["messages"]),
                      include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                      parse_tools=bool(tools_system), reply_prefix=forced, ttl_seconds=parsed.ttl,
                      cache_mode=parsed.cache_mode, system_digest=content_digest("tools", tools_system),
                      message_digests=tuple(content_digest(m.role, m.content) for m in rendered),
                      parts=_parts(rendered, tools_system) if syntax is None else _parts(messages, ""),
                      tool_syntax=syntax, tool_specs=specs)


def _parts(rendered: list[ChatMessage], tools_system: str) -> tuple[tuple[str, str], ...]:
    """The prompt's pieces in order: the tools section follows a leading system message."""
    parts = [(f"messages.{i}", m.content) for i, m in enumerate(rendered)]
    parts.insert(1 if rendered[0].role == "system" else 0, ("tools", tools_system))
    return tuple((label, text) for label, text in parts if text)


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "cancelled": "stop"}


def usage(finished: Finished) -> dict[str, Any]:
    return {"prompt_tokens": finished.n_prompt_tokens, "completion_tokens": finished.n_output_tokens,
            "total_tokens": finished.n_prompt_tokens + finished.n_output_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.n_cached_tokens}}


def _tool_call(completion_id: str, index: int, call: tools.ToolCall) -> dict[str, Any]:
    return {"id": "call_" + hashlib.sha256(f"{completion_id}:{index}".encode()).hexdigest()[:24],
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _finish_reason(finished: Finished, called: bool) -> str:
    if called and finished.stop_reason in ("end_turn", "stop_sequence"):
        return "tool_calls"
    return FINISH_REASONS[finished.stop_reason]


def reply_message(completion_id: str, parsed: ParsedTurn, text: str) -> dict[str, Any]:
    """The assistant message: its text and, when tools were offered, its tool calls."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in parse_reply(parsed, text):
        if isinstance(part, tools.ToolCall):
            calls.append(_tool_call(completion_id, len(calls), part))
        elif isinstance(part, str):
            texts.append(part)
    content = "".join(texts)
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}


def render_message(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> dict[str, Any]:
    message = reply_message(completion_id, parsed, text)
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": parsed.model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(finished, "tool_calls" in message)}],
        "usage": usage(finished),
    }


def render_chunks(completion_id: str, parsed: ParsedTurn,
                  events: Iterator[Started | TextDelta | Finished | Heartbeat]) -> Iterator[dict[str, Any] | str | Heartbeat]:
    """Engine events -> ``chat.completion.chunk`` objects, then the ``[DONE]`` marker; a
    heartbeat as it came."""
    created = int(time.time())
    parser = ReplyParser.for_turn(parsed)
    n_calls = 0

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": parsed.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def deltas(parts: list[Any]) -> Iterator[dict[str, Any]]:
        nonlocal n_calls
        for part in parts:
            if isinstance(part, tools.ToolCall):
                yield chunk({"tool_calls": [{"index": n_calls, **_tool_call(completion_id, n_calls, part)}]}, None)
                n_calls += 1
            elif isinstance(part, str) and part:
                yield chunk({"content": part}, None)

    for event in events:
        if isinstance(event, Heartbeat):
            yield event  # the stream sends it as a comment (app.api.sse.keep_alive)
        elif isinstance(event, Started):
            yield chunk({"role": "assistant", "content": ""}, None)
        elif isinstance(event, TextDelta):
            yield from deltas(parser.feed(event.text))
        else:
            yield from deltas(parser.finish())
            yield chunk({}, _finish_reason(event, n_calls > 0))
            if parsed.include_usage:
                yield {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": parsed.model, "choices": [], "usage": usage(event)}
    yield "[DONE]"


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
               404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               529: "server_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 429: "rate_limit_exceeded",
               529: "overloaded"}


def render_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": ERROR_CODES.get(status)}}
