"""Anthropic Messages API: parse requests, render responses, events and errors. Pure.

Request validation follows the real API: unknown fields are ignored, wrong
types and missing fields are a 400 ``invalid_request_error`` whose message
names the field (``messages.0.content: Field required``).

Structured outputs: ``output_format`` (and ``output_config.format``) ``json_schema`` hold
the reply to the schema (``app.protocol.structured``; a prefilled final assistant message
is the start of it), and a forced tool call (``tool_choice`` any / tool) is held to the
tool's ``input_schema`` in the generic tool format (and in a model's own format where
``structured.OWN_FORMATS`` knows it). Fields this server cannot honour and
that would change the answer (``mcp_servers``, ``container``) are a 400 naming the field.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest
from app.protocol import claude_code, structured, tool_format, tools
from app.protocol.reply import THINK_END, THINK_START, Reply, ReplyParser, Thinking, parse_reply
from app.protocol.turn import ParsedTurn, content_digest
from app.protocol.validation import ModelName, validate
from app.types import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    ChatMessage,
    Finished,
    Heartbeat,
    OutputConstraint,
    RequestOptions,
    SamplingParams,
    Started,
    TextDelta,
    ToolCall,
    ToolSyntax,
)

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Strict):
    """Earlier reasoning: rendered back as the ``<think>`` text it was parsed from."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Strict):
    """Reasoning another server encrypted: nothing a local model can read."""

    type: Literal["redacted_thinking"]


class UnsupportedBlock(_Strict):
    """Block types this server version does not render yet."""

    type: Literal["document"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
                  | UnsupportedBlock, Field(discriminator="type")]


class MessageIn(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Metadata(_Strict):
    user_id: str | None = None


class ToolDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=dict)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: Any = None  # accepted: how hard a Claude model thinks (a local model's depth is its own)


class MessagesBody(_Strict):
    model: ModelName
    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    speculate: bool = True
    output_format: OutputFormat | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[Any] | None = None  # refused unless empty
    container: Any = None  # refused


def _refuse_unsupported(parsed: MessagesBody) -> None:
    """Fields that would change the answer in ways this server cannot honour.

    Raises:
        InvalidRequest: naming the field.
    """
    if parsed.mcp_servers:
        raise InvalidRequest("mcp_servers: remote MCP servers are not supported (the client runs its tools)",
                             "mcp_servers")
    if parsed.container is not None:
        raise InvalidRequest("container: code execution containers are not supported", "container")
    if parsed.output_format is not None and parsed.output_config is not None and parsed.output_config.format:
        raise InvalidRequest("output_config.format: give the format once (output_format or output_config.format)",
                             "output_config.format")


def _output_schema(parsed: MessagesBody) -> tuple[str, dict[str, Any]] | None:
    """(where the requested JSON schema is, the schema), or None: plain text."""
    if parsed.output_format is not None:
        return "output_format.schema", parsed.output_format.schema_
    if parsed.output_config is not None and parsed.output_config.format is not None:
        return "output_config.format.schema", parsed.output_config.format.schema_
    return None


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
        if isinstance(block, ToolUseBlock):
            parts.append(tools.render_call(block.name, block.input))
        elif isinstance(block, ToolResultBlock):
            parts.append(tools.render_result(_flatten(block.content, f"{where}.{i}.content"), block.is_error))
        elif isinstance(block, ThinkingBlock):
            parts.append(f"{THINK_START}{block.thinking}{THINK_END}")
        elif isinstance(block, TextBlock):
            parts.append(block.text)
    return "\n".join(parts)


def _for_template(message: MessageIn, flat: str, syntax: ToolSyntax) -> list[ChatMessage]:
    """A message as a template that writes tool calls itself sees it: an assistant's
    ``tool_use`` blocks as its calls, a user's ``tool_result`` blocks as ``tool`` messages
    (before the rest of the message). ``flat``: the message in the generic format (it is
    valid: ``_flatten`` checked it)."""
    if isinstance(message.content, str) or not any(isinstance(b, (ToolUseBlock, ToolResultBlock))
                                                    for b in message.content):
        return [ChatMessage(message.role, flat)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for block in message.content:
        if isinstance(block, ToolUseBlock) and message.role == "assistant":
            calls.append(ToolCall(block.name, block.input, block.id))
        elif isinstance(block, ToolResultBlock) and message.role != "assistant":
            content = _flatten(block.content, "content")
            results.append(ChatMessage("tool", tool_format.result_text(content, block.is_error, syntax),
                                       tool_call_id=block.tool_use_id))
        else:
            texts.append(_flatten([block], "content"))
    text = "\n".join(texts)
    return [*results, *([ChatMessage(message.role, text, tuple(calls))] if text or calls else [])]


def system_digest(system_text: str) -> str:
    """What identifies a conversation's start besides its messages: the system prompt with
    the tools section (as rendered; "" for none)."""
    return content_digest("system", system_text)


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


def _system_texts(system: str | list[TextBlock] | None, options: RequestOptions) -> list[str]:
    texts = [system] if isinstance(system, str) else [block.text for block in system or []]
    return claude_code.drop_billing_header(texts) if options.stable_prompts else texts


def _system_parts(system: str | list[TextBlock] | None, options: RequestOptions) -> claude_code.SystemParts:
    """The system prompt as rendered: its stable text and the snapshot closing it."""
    text = "\n".join(_system_texts(system, options))
    return claude_code.split_system(text, options.fit) if options.stable_prompts else claude_code.SystemParts(text, "")


def _identity(system: str | list[TextBlock] | None, options: RequestOptions) -> str:
    """The system prompt as it identifies a conversation: without what volatile or optional
    parts it has, so fitting a long conversation or a new snapshot keeps it the same one."""
    text = "\n".join(_system_texts(system, options))
    return claude_code.split_system(text, fit=True).stable if options.stable_prompts else text


def parse_request(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate a decoded JSON body.

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(MessagesBody, body)
    _refuse_unsupported(parsed)
    if parsed.max_tokens > options.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens: {parsed.max_tokens} > {options.max_output_tokens}, the maximum allowed "
            "number of output tokens", "max_tokens",
        )
    messages: list[ChatMessage] = []
    system = _system_parts(parsed.system, options)
    syntax = options.tool_syntax
    choice = parsed.tool_choice or ToolChoice(type="auto")
    use_tools = bool(parsed.tools) and choice.type != "none"
    offered = claude_code.canonical_tools(parsed.tools or []) if options.stable_prompts else parsed.tools or []
    # The tools as the generic format writes them: in the system prompt, or (a model's own
    # format: the template writes them) only in the conversation's identity.
    tools_text = tools.render_tools_system([t.model_dump() for t in offered]) if use_tools else ""
    in_system = tools_text if syntax is None else ""
    output = _output_schema(parsed)
    format_text = structured.instructions(output[1]) if output else ""
    system_text = "\n\n".join(p for p in (system.stable + system.snapshot, in_system, format_text) if p)
    if system_text:
        messages.append(ChatMessage("system", system_text))
    parts = [("system", system.stable + system.snapshot), ("tools", in_system), ("output_format", format_text)]
    flat = [_flatten(message.content, f"messages.{i}.content") for i, message in enumerate(parsed.messages)]
    for i, (message, text) in enumerate(zip(parsed.messages, flat)):
        pieces = [ChatMessage(message.role, text)] if syntax is None else _for_template(message, text, syntax)
        messages += pieces
        parts += [(f"messages.{i}", piece.content) for piece in pieces]
    digests = tuple(content_digest(m.role, text) for m, text in zip(parsed.messages, flat))
    forced = _forced_call(choice, parsed.tools or [], syntax)
    prefill = _prefill(messages, len(parsed.messages) - 1, forced)
    constraint = _constraint(parsed, output, choice, forced, prefill, syntax) if use_tools or output else None
    sampling = SamplingParams(
        temperature=options.default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=parsed.top_k or 0,
        max_tokens=parsed.max_tokens,
        stop_sequences=tuple(parsed.stop_sequences),
        end_after=tool_format.end_markers(syntax) if use_tools else (),
        speculate=parsed.speculate, constraint=constraint,
    )
    specs = tuple(tool_format.tool_spec(t.name, t.description, t.input_schema) for t in offered)
    return ParsedTurn(
        model=parsed.model,
        messages=tuple(messages),
        sampling=sampling,
        stream=parsed.stream,
        session_id=session_from_user_id(parsed.metadata.user_id if parsed.metadata else None),
        raw_messages=tuple(body["messages"]),
        parse_tools=use_tools,
        parse_thinking=parsed.thinking is not None and parsed.thinking.type != "disabled",
        prefill=prefill,
        reply_prefix=forced,
        hot_ttl_seconds=cache_ttl(body),
        system_digest=system_digest("\n\n".join(p for p in (_identity(parsed.system, options), tools_text) if p)),
        snapshot=system.snapshot,
        message_digests=digests,
        parts=tuple((label, text) for label, text in parts if text),
        tool_syntax=syntax,
        tool_specs=specs if use_tools and syntax is not None else (),
        offered_tools=specs if use_tools else (),
    )


def _prefill(messages: list[ChatMessage], last: int, forced: str) -> str:
    """A final assistant message is the start of the reply (the model continues
    it; the response holds only the continuation). Removed from ``messages``."""
    if messages[-1].role != "assistant":
        return ""
    if messages[-1].tool_calls:
        raise InvalidRequest(f"messages.{last}.content: a final assistant message with tool_use blocks cannot be "
                             "continued", f"messages.{last}.content")
    text = messages.pop().content
    if text != text.rstrip():
        raise InvalidRequest(f"messages.{last}.content: final assistant content cannot end with trailing whitespace",
                             f"messages.{last}.content")
    if forced:
        raise InvalidRequest("tool_choice: a tool call cannot be forced after a prefilled assistant message",
                             "tool_choice")
    return text


def _constraint(parsed: MessagesBody, output: tuple[str, dict[str, Any]] | None, choice: ToolChoice, forced: str,
                prefill: str, syntax: ToolSyntax | None) -> OutputConstraint | None:
    """What holds the reply: a forced call to its tool's ``input_schema`` (the generic format, or
    a model's own that ``structured.OWN_FORMATS`` knows), else the output format (a reply that
    may call one of the tools instead)."""
    offered = [(t.name, t.input_schema) for t in parsed.tools or []] if choice.type != "none" else []
    if forced:
        name = choice.name if choice.type == "tool" else None
        return structured.forced_call(offered, name, forced, syntax)
    if output is None:
        return None
    where, schema = output
    if offered and syntax is not None:
        raise InvalidRequest(f"{where}: a JSON format with tools needs the generic tool-call format; this model "
                             "writes calls in its own", where)
    return structured.response_format(schema, where, prefix=prefill, offered=offered)


def _forced_call(choice: ToolChoice, offered: list[ToolDefinition], syntax: ToolSyntax | None) -> str:
    """``tool_choice`` any / tool: the reply is made to start a tool call."""
    if choice.type in ("auto", "none"):
        return ""
    if not offered:
        raise InvalidRequest(f"tool_choice: type '{choice.type}' requires tools", "tool_choice")
    if choice.type == "any":
        return tool_format.forced_start(syntax, None)
    if choice.name not in {t.name for t in offered}:
        raise InvalidRequest(f"tool_choice.name: {choice.name!r} is not one of the tools offered", "tool_choice.name")
    return tool_format.forced_start(syntax, choice.name)


CACHE_TTLS = {"5m": 300, "1h": 3600}


def cache_ttl(body: dict[str, Any]) -> int | None:
    """The longest ``cache_control`` TTL the request asks for, in seconds (None: no hint).

    ``{"type": "ephemeral"}`` is 5 minutes, ``"ttl": "1h"`` an hour, as on the
    real API. Hints sit on system blocks, tools and message content blocks.

    Raises:
        InvalidRequest: a ttl other than "5m" or "1h".
    """
    places: list[tuple[str, Any]] = []
    for key in ("system", "tools"):
        if isinstance(body.get(key), list):
            places += [(f"{key}.{i}", block) for i, block in enumerate(body[key])]
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            places += [(f"messages.{i}.content.{j}", block) for j, block in enumerate(content)]
    longest = None
    for where, block in places:
        control = block.get("cache_control") if isinstance(block, dict) else None
        if not isinstance(control, dict):
            continue
        ttl = control.get("ttl", "5m")
        if not isinstance(ttl, str) or ttl not in CACHE_TTLS:
            raise InvalidRequest(f"{where}.cache_control.ttl: Input should be '5m' or '1h'",
                                 f"{where}.cache_control.ttl")
        longest = max(longest or 0, CACHE_TTLS[ttl])
    return longest


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(n_prompt: int, n_cached: int, n_written: int, n_output: int | None) -> dict[str, int]:
    """Anthropic usage: input + cache_read + cache_creation = the whole prompt.

    Tokens reused from a cache are ``cache_read``; prompt tokens
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


def _stop_reason(finished: Finished, used_tool: bool) -> str:
    if finished.stop_reason == "cancelled":
        return "end_turn"
    if used_tool and finished.stop_reason in ("end_turn", "stop_sequence"):
        return "tool_use"
    return finished.stop_reason


def _tool_id(message_id: str, index: int) -> str:
    return "toolu_" + hashlib.sha256(f"{message_id}:{index}".encode()).hexdigest()[:24]


def _signature(thinking: str) -> str:
    """An opaque token for a thinking block (clients send it back; nothing checks it here)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def message_digest(message: dict[str, Any]) -> str:
    """The digest of a message in its stored (request) shape, e.g. a reply as history keeps it."""
    valid = validate(MessageIn, message)
    return content_digest(valid.role, _flatten(valid.content, "content"))


def content_blocks(message_id: str, parsed: ParsedTurn, text: str) -> list[dict[str, Any]]:
    """The reply's content blocks: thinking, text and tool_use, as the request allows."""
    blocks: list[dict[str, Any]] = []
    for part in parse_reply(parsed, text):
        if isinstance(part, tools.ToolCall):
            blocks.append({"type": "tool_use", "id": _tool_id(message_id, len(blocks)), "name": part.name,
                           "input": part.arguments})
        elif isinstance(part, Thinking):
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += part.text
            else:
                blocks.append({"type": "thinking", "thinking": part.text})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += part
        elif part.strip() or not (parsed.parse_tools or parsed.parse_thinking):
            blocks.append({"type": "text", "text": part})
    for block in blocks:
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
    return blocks or [{"type": "text", "text": ""}]


def reply_message(message_id: str, parsed: ParsedTurn, text: str) -> dict[str, Any]:
    """The reply as a request message (how the client sends it back, and history keeps it)."""
    return {"role": "assistant", "content": content_blocks(message_id, parsed, text)}


def render_message(message_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> dict[str, Any]:
    """The non-streaming response body."""
    return _message_body(message_id, parsed, content_blocks(message_id, parsed, text), finished)


def whole_reply(message_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> Reply:
    """The non-streaming reply: its body and what history keeps, from one parse of ``text``."""
    blocks = content_blocks(message_id, parsed, text)
    return Reply(_history(message_id, parsed, blocks, text), body=_message_body(message_id, parsed, blocks, finished))


def _history(message_id: str, parsed: ParsedTurn, blocks: list[dict[str, Any]], text: str) -> tuple[dict[str, Any]]:
    """The reply as history keeps it: its ``blocks``; a prefilled reply (a final assistant message
    sent by the client) is the prefill and ``text`` as one message, read as one."""
    if parsed.prefill:
        return (reply_message(message_id, parsed, parsed.prefill + text),)
    return ({"role": "assistant", "content": blocks},)


def _message_body(message_id: str, parsed: ParsedTurn, blocks: list[dict[str, Any]],
                  finished: Finished) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": parsed.model,
        "content": blocks,
        "stop_reason": _stop_reason(finished, any(b["type"] == "tool_use" for b in blocks)),
        "stop_sequence": finished.stop_sequence,
        "usage": usage(finished.n_prompt_tokens, finished.n_cached_tokens, finished.n_cache_written,
                       finished.n_output_tokens),
    }


Event = tuple[str, dict[str, Any]]


class _Blocks:
    """Content block bookkeeping for a stream: indexes, which block is open, and the blocks
    sent so far, whole (``content``: what ``content_blocks`` gives for the whole reply)."""

    def __init__(self, message_id: str) -> None:
        self._message_id = message_id
        self.index = -1
        self.open: str | None = None  # type of the open block
        self._thinking = ""
        self.used_tool = False
        self.content: list[dict[str, Any]] = []

    def _start(self, block: dict[str, Any], whole: dict[str, Any]) -> Iterator[Event]:
        yield from self.stop()
        self.index += 1
        self.open = block["type"]
        self.content.append(whole)
        yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def stop(self) -> Iterator[Event]:
        if self.open == "thinking":
            self.content[-1]["signature"] = _signature(self._thinking)
            yield self._delta({"type": "signature_delta", "signature": _signature(self._thinking)})
        if self.open is not None:
            self.open = None
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}

    def start_text(self) -> Iterator[Event]:
        yield from self._start({"type": "text", "text": ""}, {"type": "text", "text": ""})

    def text(self, text: str) -> Iterator[Event]:
        if self.open != "text":
            yield from self.start_text()
        self.content[-1]["text"] += text
        yield self._delta({"type": "text_delta", "text": text})

    def thinking(self, text: str) -> Iterator[Event]:
        if self.open != "thinking":
            self._thinking = ""
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking", "thinking": ""})
        self._thinking += text
        self.content[-1]["thinking"] += text
        yield self._delta({"type": "thinking_delta", "thinking": text})

    def tool(self, call: tools.ToolCall) -> Iterator[Event]:
        self.used_tool = True
        tool_id = _tool_id(self._message_id, self.index + 1)
        yield from self._start({"type": "tool_use", "id": tool_id, "name": call.name, "input": {}},
                               {"type": "tool_use", "id": tool_id, "name": call.name, "input": call.arguments})
        yield self._delta({"type": "input_json_delta",
                           "partial_json": json.dumps(call.arguments, ensure_ascii=False)})
        yield from self.stop()


def render_events(message_id: str, parsed: ParsedTurn,
                  events: Iterator[Started | TextDelta | Finished | Heartbeat]) -> Iterator[Event | Reply]:
    """Engine events -> (event name, data) pairs of Anthropic's SSE stream; once generation
    finished, the ``Reply`` the stream sent, before its closing events."""
    structured = parsed.parse_tools or parsed.parse_thinking
    parser = ReplyParser.for_turn(parsed)
    blocks = _Blocks(message_id)
    texts: list[str] = []  # the reply's text (a prefilled reply's history reads it whole)

    def parts(found: list[Any]) -> Iterator[Event]:
        for part in found:
            if isinstance(part, tools.ToolCall):
                yield from blocks.tool(part)
            elif isinstance(part, Thinking):
                yield from blocks.thinking(part.text)
            elif part and (blocks.open == "text" or part.strip()):
                yield from blocks.text(part)

    started = False
    for event in events:
        if isinstance(event, Heartbeat):
            if started:  # the SDKs expect message_start before anything else
                yield "ping", {"type": "ping"}
        elif isinstance(event, Started):
            started = True
            yield "message_start", {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": parsed.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(event.n_prompt_tokens, event.n_cached_tokens, event.n_cache_written, 1),
            }}
            if not structured:
                yield from blocks.start_text()
            yield "ping", {"type": "ping"}
        elif isinstance(event, TextDelta):
            texts.append(event.text)
            yield from parts(parser.feed(event.text))
        else:
            closing = list(parts(parser.finish()))
            if blocks.index < 0:
                closing += blocks.start_text()
            closing += blocks.stop()
            yield Reply(_history(message_id, parsed, blocks.content, "".join(texts)))
            yield from closing
            yield "message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(event, blocks.used_tool), "stop_sequence": event.stop_sequence},
                "usage": usage(event.n_prompt_tokens, event.n_cached_tokens, event.n_cache_written,
                               event.n_output_tokens),
            }
            yield "message_stop", {"type": "message_stop"}


ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "api_error", 503: "api_error", 529: "overloaded_error",
}


def render_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
