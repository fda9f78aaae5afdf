"""The OpenAPI 3.1 document of the running app, generated from Falcon's router and the
pydantic models that validate request bodies.

Every route and method the router holds is in the document (``falcon.inspect``): what a
route takes and answers is said in ``OPERATIONS``; a route missing there still appears,
marked ``x-undocumented`` (tests/api/test_openapi.py fails on it). Request bodies are
the models' JSON schemas, error bodies the shapes the protocols' renderers produce, and
the security schemes the headers ``AuthMiddleware`` accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import falcon
from falcon import inspect as falcon_inspect
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import __version__
from app.api.agents import CreateAgent, ForkAgent
from app.api.errors import RENDERERS, STATUS
from app.api.middleware import OPEN_PATHS, protocol_of
from app.api.people_page import FILES as PAGE_FILES
from app.errors import InvalidRequest
from app.protocol.anthropic import MessagesBody
from app.protocol.completions import CompletionBody
from app.protocol.direct import SAMPLING_FIELDS
from app.protocol.ollama import OllamaChatBody, OllamaGenerateBody, OllamaShowBody
from app.protocol.openai import ChatBody
from app.protocol.responses import ResponsesBody

REF = "#/components/schemas/{model}"
UNDOCUMENTED = "x-undocumented"


@dataclass(frozen=True)
class Body:
    """A request body: ``model``'s schema, or a component ``name`` narrowed from it
    (only the properties ``keep``, ``required`` instead of the model's)."""

    model: type[BaseModel]
    name: str | None = None
    keep: tuple[str, ...] | None = None
    required: tuple[str, ...] | None = None
    optional: bool = False  # may be left out (every field has a default)
    added: tuple[tuple[str, str, str], ...] = ()  # properties the model lacks: (name, JSON type, description)


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    summary: str
    body: Body | None = None
    answers: str | None = "application/json"  # the success body's media type (None: no body)
    status: int = 200
    streams: bool = False  # answers a stream (``stream_type``) when the body sets "stream": true
    stream_type: str = "text/event-stream"  # server-sent events; the Ollama API's: NDJSON
    query: tuple[Param, ...] = ()
    description: str = ""


_GENERATE = (*SAMPLING_FIELDS, "messages")

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/"): Operation("Links to this server's pages and the API references (HTML for a browser, else JSON)",
                            answers="text/html"),
    ("HEAD", "/"): Operation("Whether the server answers (Claude Code probes it first)", answers=None),
    ("GET", "/health"): Operation("Health, model, version, engine counters; 503 while the model loads"),
    ("GET", "/status"): Operation("The operator page: engine, memory, caches by tier, agents, misses, jobs",
                                  answers="text/html"),
    ("GET", "/metrics"): Operation("Prometheus metrics", answers="text/plain"),
    ("POST", "/session"): Operation("The key form of / (a browser's form, key=...): the right key sets the "
                                    "HttpOnly page cookie that opens /status and /docs; 303 to /",
                                    answers=None, status=303),
    **{("GET", path): Operation(f"The agents page: {name} (a static file, served without the key)",
                                answers=content_type.split(";")[0])
       for path, (name, content_type) in PAGE_FILES.items()},
    ("GET", "/openapi.json"): Operation("This document"),
    ("GET", "/docs"): Operation("This document as a page", answers="text/html"),
    ("GET", "/v1/models"): Operation("The models a request may name (Anthropic and OpenAI list shapes)"),
    ("POST", "/v1/messages"): Operation(
        "Anthropic Messages API: generate the next assistant message", Body(MessagesBody), streams=True,
        description="Claude Code's endpoint. `x-session-id` or `metadata.user_id` name the agent; without "
                    "them the conversation is recognised by its messages."),
    ("POST", "/v1/messages/count_tokens"): Operation(
        "The tokens /v1/messages would prefill for this request",
        Body(MessagesBody, "CountTokensBody", required=("model", "messages"))),
    ("POST", "/v1/chat/completions"): Operation("OpenAI Chat Completions", Body(ChatBody), streams=True),
    ("POST", "/v1/completions"): Operation("OpenAI Completions: a raw prompt continued (suffix: fill-in-the-middle)",
                                           Body(CompletionBody), streams=True),
    ("POST", "/v1/responses"): Operation(
        "OpenAI Responses API (Codex's endpoint)", Body(ResponsesBody), streams=True,
        description="`previous_response_id` continues a stored response's conversation and cache."),
    ("GET", "/v1/responses"): Operation(
        "The Responses API over a WebSocket (Codex's `supports_websockets`)", answers=None, status=101,
        description="An upgrade to a WebSocket: each `response.create` message (a POST body) is answered with its "
                    "stream's events as JSON text messages; `previous_response_id` may name the connection's "
                    "latest response, so a turn sends only its new input (docs/responses-api.md)."),
    ("GET", "/v1/responses/{response_id}"): Operation("A stored response (`store: true`)"),
    ("DELETE", "/v1/responses/{response_id}"): Operation("Delete a stored response"),
    ("POST", "/v1/agents"): Operation("Create an agent; its system prompt is prefilled now",
                                      Body(CreateAgent, optional=True), status=201),
    ("GET", "/v1/agents"): Operation("List agents with their conversations and caches", query=(
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "agents to return"),
        Param("offset", {"type": "integer", "minimum": 0, "default": 0}, "agents to skip"))),
    ("GET", "/v1/agents/{agent_id}"): Operation("An agent: its conversations, their caches and tiers"),
    ("DELETE", "/v1/agents/{agent_id}"): Operation("Delete an agent, its history and its caches", answers=None,
                                                   status=204),
    ("POST", "/v1/agents/{agent_id}/generate"): Operation(
        "The agent's next turn: send only the new messages; the server keeps the history",
        Body(MessagesBody, "AgentGenerateBody", keep=_GENERATE, required=("messages",), added=(
            ("new_conversation", "boolean", "true: start a new conversation of the agent instead of continuing "
                                            "its latest (default false)"),)),
        streams=True),
    ("GET", "/v1/agents/{agent_id}/history"): Operation("The agent's stored messages"),
    ("POST", "/api/chat"): Operation(
        "Ollama chat: the next assistant message", Body(OllamaChatBody), streams=True,
        stream_type="application/x-ndjson",
        description="Streams NDJSON unless `stream` is false (Ollama's default is to stream). `session_id` or "
                    "`X-Session-ID` name the agent; without them the conversation is recognised by its messages."),
    ("POST", "/api/generate"): Operation(
        "Ollama generate: a completion of `prompt` (with `system`) through the chat template",
        Body(OllamaGenerateBody), streams=True, stream_type="application/x-ndjson",
        description="Streams NDJSON unless `stream` is false. `context`, `raw`, `suffix`, `template`, `images` "
                    "and `format` are refused by name."),
    ("GET", "/api/tags"): Operation("Ollama: the models a request may name"),
    ("POST", "/api/show"): Operation("Ollama: one model's details and context length", Body(OllamaShowBody)),
    ("GET", "/api/ps"): Operation("Ollama: the loaded model"),
    ("GET", "/api/version"): Operation("Ollama: this server's version"),
    ("POST", "/v1/agents/{agent_id}/fork"): Operation(
        "A new agent continuing this one's latest conversation, warm from its first turn",
        Body(ForkAgent, optional=True), status=201),
}

# The API each path speaks, for its error body's shape (``api.errors`` renders by protocol).
ERROR_SCHEMAS = {"anthropic": "AnthropicError", "openai": "OpenAIError", "responses": "ResponsesError",
                 "direct": "AnthropicError", "ollama": "OllamaError"}
_PLACEHOLDER = "\x00text"  # a string the renderer copies from its arguments (a message, a field)


def routes(app: falcon.App) -> list[tuple[str, str]]:
    """Every (method, URL template) the app serves, Falcon's own responders (OPTIONS, 405) aside."""
    return [(method.method, route.path) for route in falcon_inspect.inspect_routes(app)
            for method in route.methods if not method.internal]


def build_document(app: falcon.App, api_key_required: bool) -> dict[str, Any]:
    """The OpenAPI document of ``app``; ``api_key_required``: the server has an api_key."""
    served = routes(app)
    bodies = [op.body for key in served if (op := OPERATIONS.get(key)) and op.body]
    schemas, refs = _body_schemas(bodies)
    schemas.update({name: _error_schema(protocol) for protocol, name in ERROR_SCHEMAS.items()})
    paths: dict[str, dict[str, Any]] = {}
    for method, template in served:
        path, names = _openapi_path(template)
        paths.setdefault(path, {})[method.lower()] = _operation(method, template, names, refs, api_key_required)
    auth: list[dict[str, list[str]]] = [{"apiKey": []}, {"bearer": []}] if api_key_required else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "Semantic", "version": __version__,
                 "description": "A local LLM inference server with persistent per-agent KV caches: the Anthropic "
                                "Messages API, OpenAI Chat Completions and Responses, the Ollama API, and a "
                                "stateful agents API."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                       "description": "the server's api_key (SEMANTIC_API_KEY), when it has one"},
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "the same key as `Authorization: Bearer KEY` (OpenAI clients)"}}},
        "security": auth,
    }


def _openapi_path(template: str) -> tuple[str, list[str]]:
    """``/x/{id:int}`` -> (``/x/{id}``, [``id``]): Falcon's converters are not OpenAPI's."""
    names = re.findall(r"{(\w+)(?::[^}]*)?}", template)
    return re.sub(r"{(\w+)(?::[^}]*)?}", r"{\1}", template), names


def _operation(method: str, template: str, names: list[str], refs: dict[Body, str],
               api_key_required: bool) -> dict[str, Any]:
    op = OPERATIONS.get((method, template))
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]
    if op is None:
        return {"summary": f"{method} {template} (undocumented)", UNDOCUMENTED: True,
                **({"parameters": parameters} if parameters else {}),
                "responses": {"default": _error_response(template)}}
    result: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(method, template)}
    if op.description:
        result["description"] = op.description
    parameters += [{"name": p.name, "in": "query", "required": False, "schema": p.schema,
                    "description": p.description} for p in op.query]
    if parameters:
        result["parameters"] = parameters
    if op.body is not None:
        result["requestBody"] = {"required": not op.body.optional,
                                 "content": {"application/json": {"schema": {"$ref": refs[op.body]}}}}
    success: dict[str, Any] = {"description": "the answer" if op.answers else "no body"}
    if op.answers is not None:
        success["content"] = {op.answers: {}}
        if op.streams:
            kind = "server-sent events" if op.stream_type == "text/event-stream" else "one JSON object a line"
            success["content"][op.stream_type] = {"schema": {
                "type": "string", "description": f"{kind}, when the body sets `stream: true`"}}
    result["responses"] = {str(op.status): success, "default": _error_response(template)}
    if api_key_required and template in OPEN_PATHS:
        result["security"] = []  # the probes answer without the key
    return result


def _operation_id(method: str, template: str) -> str:
    words = re.findall(r"[a-z0-9]+", template.replace("{", "by_").lower())
    return "_".join([method.lower(), *words]) if words else f"{method.lower()}_root"


def _error_response(template: str) -> dict[str, Any]:
    statuses = ", ".join(str(s) for s in sorted(set(STATUS.values())))
    return {"description": f"an error ({statuses}, or 404/405 for an unknown route or method), in the shape of "
                           f"the {protocol_of(template)} API",
            "content": {"application/json": {"schema": {"$ref": REF.format(
                model=ERROR_SCHEMAS[protocol_of(template)])}}}}


def _body_schemas(bodies: list[Body]) -> tuple[dict[str, Any], dict[Body, str]]:
    """The request models' JSON schemas (and what they reference), plus the narrowed ones; and
    each body's reference to its schema."""
    models = sorted({body.model for body in bodies}, key=lambda m: m.__name__)
    keys, top = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    schemas: dict[str, Any] = _any_of_unions(top.get("$defs", {}))
    refs = {body: keys[(body.model, "validation")]["$ref"] for body in bodies}
    for body in bodies:
        if body.name is None:
            continue
        base = schemas[refs[body].rsplit("/", 1)[-1]]
        refs[body] = REF.format(model=body.name)
        narrowed = {**base, "title": body.name, "properties": {
            **{name: value for name, value in base["properties"].items() if body.keep is None or name in body.keep},
            **{name: {"type": kind, "description": what} for name, kind, what in body.added}}}
        narrowed["required"] = list(body.required if body.required is not None else base.get("required", []))
        schemas[body.name] = narrowed
    return schemas, refs


def _any_of_unions(node: Any) -> Any:
    """pydantic writes its discriminated unions as ``oneOf``; the discriminator (a function over
    the input) picks the member, so an input may match several schemas: ``anyOf`` says that."""
    if isinstance(node, dict):
        return {("anyOf" if key == "oneOf" else key): _any_of_unions(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_any_of_unions(item) for item in node]
    return node


def _error_schema(protocol: str) -> dict[str, Any]:
    """The error body's shape, read off what the protocol's renderer produces for every status."""
    render = RENDERERS[protocol]
    examples = [render(status, _PLACEHOLDER, None) for status in sorted({*STATUS.values(), 404, 405, 500})]
    examples.append(render(400, _PLACEHOLDER, InvalidRequest(_PLACEHOLDER, _PLACEHOLDER)))
    return {"title": ERROR_SCHEMAS[protocol], **_shape(examples)}


def _shape(values: list[Any]) -> dict[str, Any]:
    """A JSON schema that every value of ``values`` satisfies; strings the renderer chose
    (an error type, a code) become the schema's examples."""
    kinds: dict[str, list[Any]] = {}
    for value in values:
        kinds.setdefault(_json_type(value), []).append(value)
    shapes = [_shape_of(kind, same) for kind, same in sorted(kinds.items())]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def _json_type(value: Any) -> str:
    for kind, types in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float),
                        ("string", str), ("array", list), ("object", dict)):
        if isinstance(value, types):
            return kind
    raise TypeError(f"not a JSON value: {value!r}")


def _shape_of(kind: str, values: list[Any]) -> dict[str, Any]:
    if kind == "object":
        keys = sorted({key for value in values for key in value})
        return {"type": "object", "required": [k for k in keys if all(k in v for v in values)],
                "properties": {k: _shape([v[k] for v in values if k in v]) for k in keys}}
    if kind == "array":
        items = [item for value in values for item in value]
        return {"type": "array", **({"items": _shape(items)} if items else {})}
    if kind == "string":
        chosen = sorted({v for v in values if v != _PLACEHOLDER})
        return {"type": "string", **({"examples": chosen} if chosen else {})}
    return {"type": kind}
