"""OpenAI Responses API requests: validate them and render their input items for the model. Pure.

``text.format`` ``json_object`` / ``json_schema`` hold the reply to JSON
(``app.protocol.structured``), as the OpenAI chat API's ``response_format`` does.

Input items (``input``, a string or a list): messages (roles user, assistant, system,
developer; ``input_text`` / ``output_text`` / ``refusal`` parts, or a string),
``function_call`` / ``function_call_output``, ``custom_tool_call`` /
``custom_tool_call_output``, and ``reasoning`` (accepted and ignored: another model's
encrypted thoughts mean nothing here). Other item types, image/file/audio parts and
request fields that would change the answer in ways this server cannot honour
(log probabilities, prompt templates, background runs, ...) are a 400 naming the field.

The chat template sees: one system message (``instructions``, the leading
developer/system items and the tools section), then user and assistant turns, each
run of same-side items merged into one turn (tool results are the user's side; a
later developer message joins the user's turn), so templates that require
alternating roles (Gemma) accept what Codex sends. Tools use the generic text format
of ``app.protocol.tools`` (a model with its own format, ``app.protocol.tool_format``,
gets them as definitions, calls and ``tool`` messages for its template to write):
``function`` tools as they are, ``custom`` tools (free-form or grammar input) as a
tool with one string argument ``input``, the tools of a ``namespace`` as
``<namespace>.<name>``; hosted tools (``web_search``, ...) the model
cannot run are left out, with a log line. ``app.protocol.responses_output`` turns the
reply back into items (calls with their kind and namespace).

History keeps each input item as received, identified by the digest of what the model
sees of it alone; a reply's items are digested the same way when resent.
``continue_from`` expands ``previous_response_id`` before parsing: the stored response's
history (its input and output items) goes in front of the request's input.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from app.errors import InvalidRequest
from app.protocol import codex, structured, tool_format, tools
from app.protocol.turn import ParsedTurn, content_digest
from app.protocol.validation import ModelName, validate
from app.types import ChatMessage, OutputConstraint, RequestOptions, SamplingParams, ToolCall, ToolSyntax

log = logging.getLogger(__name__)

Side = Literal["system", "user", "assistant"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Strict):
    """Image, file and audio parts: valid input the text-only models cannot read."""

    type: Literal["input_image", "input_file", "input_audio"]


Content = str | list[Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str  # JSON text
    namespace: str | None = None


class CustomToolCallItem(_Strict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str = Field(min_length=1)
    input: str
    namespace: str | None = None


class ToolOutputItem(_Strict):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str | None = None
    output: Content


class ReasoningItem(_Strict):
    type: Literal["reasoning"]


class UnsupportedItem(_Strict):
    """Any other item type (hosted tools' calls, MCP, compaction, item references)."""

    type: str = "item_reference"  # the one item type that may leave its type out


ITEM_TYPES = ("message", "function_call", "custom_tool_call", "function_call_output", "custom_tool_call_output",
              "reasoning")


def _item_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type") or ("message" if "role" in value or "id" not in value else "item_reference")
    if kind in ("function_call_output", "custom_tool_call_output"):
        return "output"
    return kind if kind in ITEM_TYPES else "unsupported"


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[CustomToolCallItem, Tag("custom_tool_call")] | Annotated[ToolOutputItem, Tag("output")]
                 | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[UnsupportedItem, Tag("unsupported")],
                 Discriminator(_item_tag)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class CustomTool(_Strict):
    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None


class NamespaceTool(_Strict):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str = ""
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]


class HostedTool(_Strict):
    """A tool the provider runs (web search, file search, code interpreter, MCP, ...)."""

    type: str


def _tool_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return None
    return kind if kind in ("function", "custom", "namespace") else "hosted"


ToolIn = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                   | Annotated[NamespaceTool, Tag("namespace")] | Annotated[HostedTool, Tag("hosted")],
                   Discriminator(_tool_tag)]


class NamedChoice(_Strict):
    type: Literal["function", "custom"]
    name: str


class AllowedTool(_Strict):
    type: str | None = None
    name: str | None = None


class AllowedTools(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class HostedChoice(_Strict):
    type: str


def _choice_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return None
    return {"function": "named", "custom": "named", "allowed_tools": "allowed"}.get(kind, "hosted")


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("mode")]
                       | Annotated[NamedChoice, Tag("named")] | Annotated[AllowedTools, Tag("allowed")]
                       | Annotated[HostedChoice, Tag("hosted")],
                       Discriminator(_choice_tag)]


class TextFormat(_Strict):
    type: str
    name: str | None = None  # json_schema
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is held either way


class TextConfig(_Strict):
    format: TextFormat | None = None


class PromptCacheOptions(_Strict):
    prewarm: bool = False


class ResponsesBody(_Strict):
    model: ModelName
    input: str | list[Item] = ""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    context_management: list[Any] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    speculate: bool = True


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """A tool as the client defined it, found by the name the model calls it by."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class ResponsesDetails:
    """What the Responses API's renderers need beyond ``ParsedTurn``."""

    tools: Mapping[str, OfferedTool]  # by the name the model calls them
    echo: Mapping[str, Any]  # request fields the response object repeats
    store: bool
    previous_response_id: str | None
    bounded: bool  # the client set max_output_tokens: reaching it leaves the response incomplete


def flat_name(name: str, namespace: str | None) -> str:
    """The name the model knows a tool by (a namespace's tools are ``<namespace>.<name>``)."""
    return f"{namespace}.{name}" if namespace else name


def _wants_logprobs(body: ResponsesBody) -> bool:
    """Whether the reply's text parts carry each token's log-probability (``include``)."""
    return "message.output_text.logprobs" in (body.include or [])


def _refuse_unsupported(body: ResponsesBody) -> None:
    """Request fields that would change the answer in ways this server cannot honour.

    Raises:
        InvalidRequest: naming the field.
    """
    refused = [
        ("conversation", body.conversation is not None, "conversation objects are not supported; "
                                                        "continue with previous_response_id"),
        ("background", bool(body.background), "background responses are not supported"),
        ("prompt", body.prompt is not None, "prompt templates are not supported"),
        ("moderation", body.moderation is not None, "moderation is not supported"),
        ("top_logprobs", body.top_logprobs is not None and not _wants_logprobs(body),
         "requires include: ['message.output_text.logprobs']"),
        ("include", _wants_logprobs(body) and bool(body.tools) and body.tool_choice != "none",
         "log probabilities are returned for plain text replies: not with tools"),
        ("include", _wants_logprobs(body) and bool(body.reasoning) and (body.reasoning or {}).get("effort") != "none",
         "log probabilities are returned for plain text replies: not with reasoning"),
        ("truncation", body.truncation == "auto", "'auto' truncation is not supported: a prompt beyond the "
                                                  "context is refused (context_length_exceeded)"),
        ("text.format.type", body.text is not None and body.text.format is not None
         and body.text.format.type not in ("text", "json_object", "json_schema"),
         "not supported: 'text', 'json_object' or 'json_schema'"),
        ("context_management", bool(body.context_management), "server-side context management is not supported"),
        ("prompt_cache_options.prewarm", bool(body.prompt_cache_options and body.prompt_cache_options.prewarm),
         "prewarming is not supported here (the direct agent API prefills a system prompt)"),
    ]
    for where, is_set, why in refused:
        if is_set:
            raise InvalidRequest(f"{where}: {why}", where)
    for key in body.metadata or {}:
        if len(key) > 64:
            raise InvalidRequest("metadata: keys are at most 64 characters", "metadata")


def _text(content: Content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, MediaPart):
            raise InvalidRequest(f"{where}.{j}: {part.type} content is not supported: the served model is text-only",
                                 f"{where}.{j}")
        texts.append(part.text if isinstance(part, TextPart) else part.refusal)
    return "\n".join(texts)


def _call_arguments(item: FunctionCallItem | CustomToolCallItem, where: str) -> Any:
    if isinstance(item, CustomToolCallItem):
        return {"input": item.input}
    try:
        return json.loads(item.arguments)
    except ValueError:
        raise InvalidRequest(f"{where}.arguments: not valid JSON", f"{where}.arguments") from None


def _rendered(item: Any, where: str) -> tuple[Side, str]:
    """One validated item (not a reasoning item) as the model sees it, on its own, in the
    generic tool format.

    Raises:
        InvalidRequest: an unsupported item or part, or call arguments that are not JSON.
    """
    if isinstance(item, MessageItem):
        side: Side = "system" if item.role in ("system", "developer") else item.role  # type: ignore[assignment]
        return side, _text(item.content, f"{where}.content")
    if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
        return "assistant", tools.render_call(flat_name(item.name, item.namespace), _call_arguments(item, where))
    if isinstance(item, ToolOutputItem):
        return "user", tools.render_result(_text(item.output, f"{where}.output"), False)
    assert isinstance(item, UnsupportedItem), item
    raise InvalidRequest(f"{where}.type: '{item.type}' items are not supported by this server", f"{where}.type")


def _for_template(item: Any, side: Side, text: str, where: str, syntax: ToolSyntax) -> ChatMessage:
    """One item as a template that writes tool calls itself sees it (``side`` and ``text``:
    as ``_rendered`` found it, which checked it)."""
    if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
        arguments = tool_format.as_arguments(_call_arguments(item, where))
        return ChatMessage("assistant", "", (ToolCall(flat_name(item.name, item.namespace), arguments, item.call_id),))
    if isinstance(item, ToolOutputItem):
        return ChatMessage("tool", tool_format.result_text(_text(item.output, f"{where}.output"), False, syntax),
                           tool_call_id=item.call_id or "")
    return ChatMessage(side, text)


class _OneItem(_Strict):
    item: Item


def item_digest(item: dict[str, Any]) -> str:
    """The digest of one item in its request shape (also a reply item as history keeps it)."""
    return content_digest(*_rendered(validate(_OneItem, {"item": item}).item, "item"))


def _offered(body: ResponsesBody, stable: bool) -> list[tuple[OfferedTool, str, dict[str, Any]]]:
    """The tools the model is offered: (tool, description, JSON schema of its arguments)."""
    one_string = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    offered = []

    def add(tool: FunctionTool | CustomTool, namespace: str | None) -> None:
        kind: Literal["function", "custom"] = tool.type
        schema = (tool.parameters or {}) if isinstance(tool, FunctionTool) else one_string
        offered.append((OfferedTool(kind, tool.name, namespace), tool.description or "", schema))

    for tool in body.tools or []:
        if isinstance(tool, NamespaceTool):
            for member in tool.tools:
                add(member, tool.name)
        elif isinstance(tool, (FunctionTool, CustomTool)):
            add(tool, None)
        else:
            log.info("hosted tool %r left out: the served model cannot run it", tool.type)
    if stable:
        offered.sort(key=lambda entry: flat_name(entry[0].name, entry[0].namespace))
    return offered


def _format_schema(body: ResponsesBody) -> tuple[bool, dict[str, Any] | None]:
    """(whether ``text.format`` asks for JSON, its schema: None for any JSON object)."""
    spec = body.text.format if body.text is not None else None
    if spec is None or spec.type not in ("json_object", "json_schema"):
        return False, None
    return True, (spec.schema_ if spec.schema_ is not None else {}) if spec.type == "json_schema" else None


def _format_constraint(body: ResponsesBody, syntax: ToolSyntax | None,
                       offered: list[tuple[str, dict[str, Any]]]) -> OutputConstraint | None:
    """``text.format`` as a grammar (a reply that may also call one of ``offered``).

    Raises:
        InvalidRequest: a schema llguidance cannot hold; tools in a model's own format.
    """
    wanted, schema = _format_schema(body)
    if not wanted:
        return None
    where = "text.format.schema" if schema is not None else "text.format"
    if offered and syntax is not None:
        raise InvalidRequest(f"{where}: a JSON format with tools needs the generic tool-call format; this model "
                             "writes calls in its own", "text.format")
    return structured.response_format(schema, where, offered=offered)


def _tool_setup(body: ResponsesBody, stable: bool, syntax: ToolSyntax | None
                ) -> tuple[str, str, dict[str, OfferedTool], tuple[dict[str, Any], ...], OutputConstraint | None]:
    """(the tools in the generic format's system prompt section, the forced start of the reply,
    the tools by flat name, the tools as chat templates take them, what holds the reply: a
    forced call's schema (the generic format, or a model's own that ``structured.OWN_FORMATS``
    knows), or ``text.format``).

    Raises:
        InvalidRequest: a tool choice naming a tool that is not offered, or a hosted tool.
    """
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    offered = _offered(body, stable)
    if isinstance(choice, HostedChoice):
        raise InvalidRequest(f"tool_choice.type: '{choice.type}' is a hosted tool this server does not run",
                             "tool_choice.type")
    if isinstance(choice, AllowedTools):
        allowed = {t.name for t in choice.tools if t.name}
        offered = [entry for entry in offered if entry[0].name in allowed
                   or flat_name(entry[0].name, entry[0].namespace) in allowed]
    by_name = {flat_name(t.name, t.namespace): t for t, _, _ in offered}
    if choice == "none" or not offered:
        if choice not in ("auto", "none") and not isinstance(choice, AllowedTools):
            raise InvalidRequest("tool_choice: requires tools", "tool_choice")
        return "", "", {}, (), _format_constraint(body, syntax, [])
    schemas = [(flat_name(t.name, t.namespace), schema) for t, _, schema in offered]
    forced, name = "", None
    if isinstance(choice, NamedChoice):
        named = [flat for flat, t in by_name.items() if choice.name in (flat, t.name) and t.kind == choice.type]
        if len(named) != 1:
            raise InvalidRequest(f"tool_choice.name: {choice.name!r} is not one of the {choice.type} tools offered",
                                 "tool_choice.name")
        name = named[0]
        forced = tool_format.forced_start(syntax, name)
    elif choice == "required" or (isinstance(choice, AllowedTools) and choice.mode == "required"):
        forced = tool_format.forced_start(syntax, None)
    if forced:
        constraint = structured.forced_call(schemas, name, forced, syntax)
    else:
        constraint = _format_constraint(body, syntax, schemas)
    section = tools.render_tools_system([{"name": flat_name(t.name, t.namespace), "description": description,
                                          "input_schema": schema} for t, description, schema in offered])
    specs = tuple(tool_format.tool_spec(flat_name(t.name, t.namespace), description, schema)
                  for t, description, schema in offered)
    return section, forced, by_name, specs, constraint


def _chat_messages(pieces: list[ChatMessage], system: list[str]) -> list[ChatMessage]:
    """The conversation as the chat template sees it: ``system`` (instructions, leading
    developer items, tools) as one message, then alternating turns, each run of same-side
    items merged (a later developer message joins the user's side; an assistant's calls join
    its text; ``tool`` results stay apart)."""
    out = [ChatMessage("system", "\n\n".join(system))] if system else []
    for piece in pieces:
        role = "user" if piece.role == "system" else piece.role
        if out and out[-1].role == role and role != "tool":
            last = out[-1]
            calls = last.tool_calls + piece.tool_calls
            text = "\n".join(t for t in (last.content, piece.content) if t) if calls \
                else f"{last.content}\n{piece.content}"
            out[-1] = ChatMessage(role, text, calls)
        else:
            out.append(ChatMessage(role, piece.content, piece.tool_calls, piece.tool_call_id))
    return out


def _echo(body: dict[str, Any], parsed: ResponsesBody) -> dict[str, Any]:
    """The request fields a response object repeats (and when it was created)."""
    return {"created_at": int(time.time()), "instructions": parsed.instructions,
            "max_output_tokens": parsed.max_output_tokens,
            "metadata": parsed.metadata or {}, "parallel_tool_calls": parsed.parallel_tool_calls is not False,
            "reasoning": parsed.reasoning or {"effort": None, "summary": None}, "temperature": parsed.temperature,
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": parsed.top_p, "truncation": "disabled",
            "user": body.get("user"), "store": parsed.store is not False}


def input_items(value: Any) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message).

    Raises:
        InvalidRequest: neither a string nor a list.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if value else []
    if not isinstance(value, list):
        raise InvalidRequest("input: Input should be a valid string or list", "input")
    return value


class History(Protocol):
    """What a stored response continues from: its input and output items, as history keeps them."""

    @property
    def items(self) -> tuple[Any, ...]: ...


Point = TypeVar("Point", bound=History)


def continue_from(body: Any, lookup: Callable[[str], Point]) -> tuple[Any, Point | None]:
    """A decoded request body with the history of the response its ``previous_response_id``
    names (``lookup``) in front of its input, and what ``lookup`` found; a body that names
    none comes back as it is, with None.

    Raises:
        InvalidRequest: ``previous_response_id`` or ``input`` of the wrong type. What
            ``lookup`` raises (NotFound: no such stored response).
    """
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous is None:
        return body, None
    if not isinstance(previous, str):
        raise InvalidRequest("previous_response_id: Input should be a valid string", "previous_response_id")
    point = lookup(previous)
    return {**body, "input": [*point.items, *input_items(body.get("input", ""))]}, point


def parse_request(body: Any, options: RequestOptions) -> ParsedTurn:
    """Validate a decoded JSON body (``input`` already holds ``previous_response_id``'s
    history: ``continue_from`` puts it there). Without ``max_output_tokens`` the reply
    is bounded by ``options.default_max_tokens``. With ``options.fit``, Codex's optional
    prompt sections are left out (``app.protocol.codex``).

    Raises:
        InvalidRequest: naming the first offending field.
    """
    parsed = validate(ResponsesBody, body)
    _refuse_unsupported(parsed)
    limit = parsed.max_output_tokens or options.default_max_tokens
    if limit > options.max_output_tokens:
        raise InvalidRequest(f"max_output_tokens: {limit} > {options.max_output_tokens}, the maximum allowed",
                             "max_output_tokens")
    if isinstance(parsed.input, str):
        raw_input: list[Any] = [{"role": "user", "content": parsed.input}] if parsed.input else []
        items: list[Any] = [MessageItem(role="user", content=parsed.input)] if parsed.input else []
    else:
        raw_input, items = list(body["input"]), list(parsed.input)
    kept = [(i, raw, item) for i, (raw, item) in enumerate(zip(raw_input, items))
            if not isinstance(item, ReasoningItem)]
    if not kept:
        raise InvalidRequest("input: a non-empty string or list of items is required", "input")
    syntax = options.tool_syntax
    seen = [(f"input.{i}", *_rendered(item, f"input.{i}"), item) for i, _, item in kept]  # (label, side, text, item)
    digests = tuple(content_digest(side, text) for _, side, text, _ in seen)  # as sent, fitted or not
    tools_text, forced, by_name, specs, constraint = _tool_setup(parsed, options.stable_prompts, syntax)
    wanted, schema = _format_schema(parsed)
    format_text = structured.instructions(schema) if wanted else ""
    instructions = parsed.instructions or ""
    if options.fit:
        instructions = codex.drop_optional_sections(instructions)
        seen = [(label, side, codex.drop_optional_sections(text) if side == "system" else text, item)
                for label, side, text, item in seen if not (side == "system" and codex.is_optional_message(text))]
    in_system = tools_text if syntax is None else ""
    lead = next((n for n, (_, side, _, _) in enumerate(seen) if side != "system"), len(seen))
    system = [text for text in (instructions, *(t for _, _, t, _ in seen[:lead]), in_system, format_text) if text]
    pieces = [ChatMessage(side, text) if syntax is None else _for_template(item, side, text, label, syntax)
              for label, side, text, item in seen[lead:]]
    messages = _chat_messages(pieces, system)
    parts = [("instructions", instructions), *((label, t) for label, _, t, _ in seen[:lead]), ("tools", in_system),
             ("response_format", format_text),
             *((label, piece.content) for (label, _, _, _), piece in zip(seen[lead:], pieces))]
    sampling = SamplingParams(
        temperature=options.default_temperature if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        max_tokens=limit, end_after=tool_format.end_markers(syntax) if tools_text else (),
        speculate=parsed.speculate, constraint=constraint,
        logprobs=(parsed.top_logprobs or 0) if _wants_logprobs(parsed) else None,
    )
    details = ResponsesDetails(by_name, _echo(body, parsed), parsed.store is not False, parsed.previous_response_id,
                               bounded=parsed.max_output_tokens is not None)
    return ParsedTurn(parsed.model, tuple(messages), sampling, parsed.stream, None, tuple(raw for _, raw, _ in kept),
                      parse_tools=bool(tools_text), reply_prefix=forced,
                      parse_thinking=bool(parsed.reasoning) and (parsed.reasoning or {}).get("effort") != "none",
                      system_digest=content_digest("system", f"{parsed.instructions or ''}\0{tools_text}"),
                      message_digests=digests,
                      parts=tuple((label, text) for label, text in parts if text), details=details,
                      tool_syntax=syntax, tool_specs=specs if syntax is not None else (),
                      offered_tools=specs if tools_text else ())
