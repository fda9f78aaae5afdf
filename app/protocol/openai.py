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

Output options: ``response_format`` ``json_object`` / ``json_schema`` hold the reply to JSON
(``app.protocol.structured``: a grammar the engine masks tokens with, and the schema in the
system prompt); with tools offered the reply is that JSON or one tool call. A forced call
(``tool_choice`` required or named) is held to the tool's parameters schema in the generic
format, and in a model's own format where ``structured.OWN_FORMATS`` knows it. ``seed`` makes
sampling reproducible (and ``top_k``, a common extension, is honoured); ``logprobs`` / ``top_logprobs`` return each
token's log-probability (``choices[0].logprobs.content``, streamed too). Fields this server
cannot honour and that would change the answer (``logit_bias``, ``frequency_penalty``,
``presence_penalty``, ``min_p``, ``repetition_penalty``, ``functions``, audio output,
``web_search_options``, ``n`` > 1) are a 400 naming the field unless at their neutral
value; fields that change nothing here (``user``, ``metadata``, ``store``,
``parallel_tool_calls``, ``stream_options``, ``service_tier``, ...) are accepted.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest
from app.protocol import structured, tool_format, tools
from app.protocol.reply import Reply, ReplyParser, parse_reply
from app.protocol.turn import CacheMode, ParsedTurn, content_digest
from app.protocol.validation import ModelName, validate
from app.types import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    MAX_TTL_SECONDS,
    ChatMessage,
    Finished,
    Heartbeat,
    OutputConstraint,
    RequestOptions,
    SamplingParams,
    Started,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolSyntax,
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(_Strict):
    """Image, audio and file parts: valid OpenAI input the text-only models cannot read."""

    type: Literal["image_url", "input_audio", "file"]


Content = str | list[Annotated[TextPart | MediaPart, Field(discriminator="type")]]


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


MessageIn = SystemMessage | UserMessage | AssistantMessage | ToolMessage


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


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is held either way


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatBody(_Strict):
    model: ModelName
    messages: list[Annotated[MessageIn, Field(discriminator="role")]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)] | list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]]
           | None) = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    session_id: str | None = None
    cache_mode: CacheMode = "full"
    ttl: int | None = Field(default=None, ge=0, le=MAX_TTL_SECONDS)
    speculate: bool = True
    response_format: ResponseFormat | None = None
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=0)  # (a common extension) 0: off
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Refused unless neutral (``_refuse_unsupported``): they would change the answer.
    logit_bias: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None  # (a common extension)
    repetition_penalty: float | None = None  # (a common extension)
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None


def _refuse_unsupported(parsed: ChatBody) -> None:
    """Fields that would change the answer in ways this server cannot honour, set to anything
    but their neutral value.

    Raises:
        InvalidRequest: naming the field.
    """
    refused = [
        ("logit_bias", bool(parsed.logit_bias), "token biases are not supported"),
        ("frequency_penalty", bool(parsed.frequency_penalty), "not supported (only 0, which changes nothing)"),
        ("presence_penalty", bool(parsed.presence_penalty), "not supported (only 0, which changes nothing)"),
        ("min_p", bool(parsed.min_p), "not supported (only 0, which changes nothing)"),
        ("repetition_penalty", parsed.repetition_penalty not in (None, 1.0),
         "not supported per request (only 1, which changes nothing; the server's repetition_penalty setting applies)"),
        ("functions", bool(parsed.functions), "the deprecated functions are not supported; use tools"),
        ("function_call", parsed.function_call not in (None, "none", "auto"),
         "the deprecated function_call is not supported; use tool_choice"),
        ("modalities", any(m != "text" for m in parsed.modalities or []), "only text output is supported"),
        ("audio", parsed.audio is not None, "audio output is not supported"),
        ("web_search_options", parsed.web_search_options is not None, "web search is not supported"),
        ("top_logprobs", parsed.top_logprobs is not None and not parsed.logprobs, "requires logprobs true"),
    ]
    for where, is_set, why in refused:
        if is_set:
            raise InvalidRequest(f"{where}: {why}", where)


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


def _tool_setup(parsed: ChatBody, syntax: ToolSyntax | None) -> tuple[str, str, OutputConstraint | None]:
    """(the tools in the generic format's system prompt section, the forced start of the reply,
    what holds the reply: a forced call's schema, or the response format)."""
    choice = parsed.tool_choice or "auto"
    if not parsed.tools or choice == "none":
        if choice not in ("auto", "none"):
            raise InvalidRequest("tool_choice: requires tools", "tool_choice")
        return "", "", _format_constraint(parsed, syntax, ())
    offered = [{"name": t.function.name, "description": t.function.description,
                "input_schema": t.function.parameters} for t in parsed.tools]
    schemas: list[tuple[str, dict[str, Any]]] = [(t.function.name, t.function.parameters) for t in parsed.tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t["name"] for t in offered}:
            raise InvalidRequest(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
                                 "tool_choice.function.name")
        name: str | None = choice.function.name
    elif choice == "required":
        name = None
    else:
        return tools.render_tools_system(offered), "", _format_constraint(parsed, syntax, schemas)
    forced = tool_format.forced_start(syntax, name)
    return tools.render_tools_system(offered), forced, \
        structured.forced_call(schemas, name, forced, syntax)


def _format_schema(parsed: ChatBody) -> tuple[bool, dict[str, Any] | None]:
    """(whether ``response_format`` asks for JSON, its schema: None for any JSON object)."""
    spec = parsed.response_format
    if isinstance(spec, JsonSchemaFormat):
        return True, spec.json_schema.schema_ if spec.json_schema.schema_ is not None else {}
    return isinstance(spec, JsonObjectFormat), None


def _format_constraint(parsed: ChatBody, syntax: ToolSyntax | None,
                       offered: Sequence[tuple[str, dict[str, Any]]]) -> OutputConstraint | None:
    """The response format as a grammar (a reply that may also call one of ``offered``)."""
    wanted, schema = _format_schema(parsed)
    if not wanted:
        return None
    where = "response_format.json_schema.schema" if schema is not None else "response_format"
    if offered and syntax is not None:
        raise InvalidRequest(f"{where}: a response format with tools needs the generic tool-call format; this "
                             "model writes calls in its own", "response_format")
    return structured.response_format(schema, where, offered=offered)


def parse_request(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate a decoded JSON body. Without ``max_tokens`` (or ``max_completion_tokens``)
    the reply is bounded by ``options.default_max_tokens``, as ``mlx_lm.server`` does.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(ChatBody, body)
    _refuse_unsupported(parsed)
    limit = parsed.max_completion_tokens or parsed.max_tokens or options.default_max_tokens
    if limit > options.max_output_tokens:
        raise InvalidRequest(f"max_tokens: {limit} > {options.max_output_tokens}, the maximum allowed", "max_tokens")
    syntax = options.tool_syntax
    rendered = [_rendered(m, f"messages.{i}") for i, m in enumerate(parsed.messages)]
    tools_system, forced, constraint = _tool_setup(parsed, syntax)
    wanted, schema = _format_schema(parsed)
    format_text = structured.instructions(schema) if wanted else ""
    if syntax is None:
        messages = _chat_messages(parsed.messages, rendered)
    else:
        messages = [_for_template(m, one, f"messages.{i}", syntax)
                    for i, (m, one) in enumerate(zip(parsed.messages, rendered))]
    template_messages = list(messages)
    in_system = "\n\n".join(t for t in (tools_system if syntax is None else "", format_text) if t)
    if in_system:
        if messages[0].role == "system":
            messages[0] = ChatMessage("system", f"{messages[0].content}\n\n{in_system}")
        else:
            messages.insert(0, ChatMessage("system", in_system))
    stops = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    sampling = SamplingParams(
        temperature=options.default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p, top_k=parsed.top_k or 0,
        max_tokens=limit, stop_sequences=stops,
        end_after=tool_format.end_markers(syntax) if tools_system else (),
        speculate=parsed.speculate, constraint=constraint, seed=parsed.seed,
        logprobs=(parsed.top_logprobs or 0) if parsed.logprobs else None,
    )
    offered = tuple(t.model_dump() for t in parsed.tools or ()) if tools_system else ()
    specs = offered if syntax is not None else ()
    return ParsedTurn(parsed.model, tuple(messages), sampling, parsed.stream, parsed.session_id,
                      tuple(body["messages"]),
                      include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                      parse_tools=bool(tools_system), reply_prefix=forced, ttl_seconds=parsed.ttl,
                      cache_mode=parsed.cache_mode, system_digest=content_digest("tools", tools_system),
                      message_digests=tuple(content_digest(m.role, m.content) for m in rendered),
                      parts=_parts(rendered, tools_system, format_text) if syntax is None
                      else _parts(template_messages, "", format_text),
                      tool_syntax=syntax, tool_specs=specs, offered_tools=offered)


def _parts(rendered: list[ChatMessage], tools_system: str, format_text: str = "") -> tuple[tuple[str, str], ...]:
    """The prompt's pieces in order: the tools section, then the response format's, follow a
    leading system message."""
    parts = [(f"messages.{i}", m.content) for i, m in enumerate(rendered)]
    at = 1 if rendered and rendered[0].role == "system" else 0
    parts[at:at] = [("tools", tools_system), ("response_format", format_text)]
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
    return _assistant(texts, calls)


def _assistant(texts: list[str], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message of a reply's ``texts`` and tool ``calls`` (``_tool_call``'s)."""
    content = "".join(texts)
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """One token's log-probability with its ``top_logprobs``, as OpenAI's APIs write it."""
    return {**_logprob(entry), "top_logprobs": [_logprob(t) for t in entry.top]}


def render_logprobs(parsed: ParsedTurn, entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
    """``choices[].logprobs``: each token's, with its ``top_logprobs`` (None: not asked for)."""
    if parsed.sampling.logprobs is None:
        return None
    return {"content": [logprob_entry(e) for e in entries],
            "refusal": None}


def render_message(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> dict[str, Any]:
    return _completion(completion_id, parsed, reply_message(completion_id, parsed, text), finished)


def whole_reply(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> Reply:
    """The non-streaming reply: its body and what history keeps, from one parse of ``text``."""
    message = reply_message(completion_id, parsed, text)
    return Reply((message,), body=_completion(completion_id, parsed, message, finished))


def _completion(completion_id: str, parsed: ParsedTurn, message: dict[str, Any],
                finished: Finished) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": parsed.model,
        "choices": [{"index": 0, "message": message, "logprobs": render_logprobs(parsed, finished.logprobs),
                     "finish_reason": _finish_reason(finished, "tool_calls" in message)}],
        "usage": usage(finished),
    }


def render_chunks(completion_id: str, parsed: ParsedTurn,
                  events: Iterator[Started | TextDelta | Finished | Heartbeat],
                  ) -> Iterator[dict[str, Any] | str | Heartbeat | Reply]:
    """Engine events -> ``chat.completion.chunk`` objects, then the ``[DONE]`` marker; a
    heartbeat as it came; once generation finished, the ``Reply`` the chunks sent, before
    the last ones."""
    created = int(time.time())
    parser = ReplyParser.for_turn(parsed)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": parsed.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def deltas(parts: list[Any]) -> Iterator[dict[str, Any]]:
        for part in parts:
            if isinstance(part, tools.ToolCall):
                calls.append(_tool_call(completion_id, len(calls), part))
                yield chunk({"tool_calls": [{"index": len(calls) - 1, **calls[-1]}]}, None)
            elif isinstance(part, str) and part:
                texts.append(part)
                yield chunk({"content": part}, None)

    for event in events:
        if isinstance(event, Heartbeat):
            yield event  # the stream sends it as a comment (app.api.sse.keep_alive)
        elif isinstance(event, Started):
            yield chunk({"role": "assistant", "content": ""}, None)
        elif isinstance(event, TextDelta):
            chunks = list(deltas(parser.feed(event.text)))
            if event.logprobs and parsed.sampling.logprobs is not None:
                if not chunks:  # its text is held back (a possible stop sequence or tool call)
                    chunks = [chunk({"content": ""}, None)]
                chunks[0]["choices"][0]["logprobs"] = render_logprobs(parsed, event.logprobs)
            yield from chunks
        else:
            closing = list(deltas(parser.finish()))
            yield Reply((_assistant(texts, calls),))
            yield from closing
            yield chunk({}, _finish_reason(event, bool(calls)))
            if parsed.include_usage:
                yield {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": parsed.model, "choices": [], "usage": usage(event)}
    yield "[DONE]"


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
               404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               529: "server_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 429: "rate_limit_exceeded",
               529: "overloaded"}


def render_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error body; ``param``: the field a bad request got wrong."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": ERROR_CODES.get(status)}}
