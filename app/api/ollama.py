"""The Ollama API, for the tools that only speak it: ``POST /api/chat`` and ``/api/generate``
(the shared generation lifecycle with two Ollama dialects, streamed as NDJSON), ``GET
/api/tags``, ``POST /api/show``, ``GET /api/ps`` and ``GET /api/version``.

Conversations stay warm as in the OpenAI API: ``session_id`` in the body or the
``X-Session-ID`` header names the agent; without them a resent history is recognised by
its content. Every generation is recorded with protocol "ollama".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import falcon

from app import __version__
from app.agents.identity import AgentKey, openai_agent
from app.api.body import read_json
from app.api.generation import Dialect, GenerationResource
from app.api.health import model_entries
from app.api.sse import Frames
from app.errors import InvalidRequest, SemanticError
from app.protocol import ollama, openai
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.protocol.validation import validate
from app.settings import Settings
from app.types import Finished, GenerationEvent

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface, ModelInfo

NDJSON = "application/x-ndjson"


def _named_agent(headers: Mapping[str, str], parsed: ParsedTurn) -> AgentKey | None:
    return openai_agent(headers, parsed.session_id, origin="ollama")


def _line(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def _dialect(chat: bool) -> Dialect:
    def whole_reply(completion_id: str, parsed: ParsedTurn, text: str, finished: Finished) -> Reply:
        build = ollama.chat_reply if chat else ollama.generate_reply
        return build(completion_id, parsed, text, finished, time.time())

    def render_stream(completion_id: str, parsed: ParsedTurn,
                      events: Iterator[GenerationEvent]) -> Frames:
        for value in ollama.render_lines(completion_id, parsed, events, chat, time.time):
            yield value if isinstance(value, Reply) else _line(value)

    return Dialect(
        parse=ollama.parse_chat if chat else ollama.parse_generate,
        named_agent=_named_agent,
        new_id=openai.new_completion_id,
        whole_reply=whole_reply,
        message_digest=openai.message_digest,
        render_stream=render_stream,
        render_stream_error=lambda status, message: _line(ollama.render_error(status, message)),
        error_types=openai.ERROR_TYPES,
        stream_media_type=NDJSON,
    )


OLLAMA_CHAT = _dialect(chat=True)
OLLAMA_GENERATE = _dialect(chat=False)


class OllamaGenerationResource:
    """POST /api/chat or /api/generate: a request with no prompt only loads the model (as
    Ollama answers it, ``done_reason`` "load", nothing generated or recorded); any other
    goes through the shared lifecycle."""

    def __init__(self, generation: GenerationResource, engine: EngineSurface, chat: bool) -> None:
        self._generation = generation
        self._engine = engine
        self._chat = chat

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req)
        if ollama.is_load_only(body):
            model = validate(ollama.OllamaChatBody if self._chat else ollama.OllamaGenerateBody, body).model
            self._engine.resolve(model)  # NotFound for a model that is not there
            resp.media = ollama.render_load(model, self._chat, time.time())
            return
        self._generation.respond(req, resp, lambda: body)


def _details(architecture: str) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": architecture, "families": [architecture],
            "parameter_size": "", "quantization_level": ""}


def _architecture(info: ModelInfo) -> str:
    try:
        return str(json.loads((info.path / "config.json").read_text()).get("model_type", "unknown"))
    except (OSError, ValueError):
        return "unknown"


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def _model_entry(name: str, info: ModelInfo, modified: float) -> dict[str, Any]:
    return {"name": name, "model": name,
            "modified_at": datetime.fromtimestamp(modified, UTC).isoformat().replace("+00:00", "Z"),
            "size": _size(info.path), "digest": info.fingerprint, "details": _details(_architecture(info))}


class TagsResource:
    """GET /api/tags: the models a request may name (installed models and aliases)."""

    def __init__(self, settings: Settings, engine: EngineSurface) -> None:
        self._settings = settings
        self._engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        models = []
        for name, (created, alias_of) in model_entries(self._settings, self._engine).items():
            try:
                info = self._engine.resolve(alias_of or name)
            except SemanticError:  # a model that cannot be resolved now (not found, loading) is left out
                continue
            models.append(_model_entry(name, info, created))
        resp.media = {"models": models}


class ShowResource:
    """POST /api/show: one model's details, context length and capabilities."""

    def __init__(self, engine: EngineSurface) -> None:
        self._engine = engine

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = validate(ollama.OllamaShowBody, read_json(req))
        name = body.model or body.name
        if name is None:
            raise InvalidRequest("model: Field required", "model")
        info = self._engine.resolve(name)
        architecture = _architecture(info)
        resp.media = {"license": "", "modelfile": "", "parameters": "", "template": "",
                      "details": _details(architecture),
                      "model_info": {"general.architecture": architecture,
                                     f"{architecture}.context_length": info.context_length},
                      "capabilities": ["completion", "tools"],
                      "modified_at": datetime.now(UTC).isoformat().replace("+00:00", "Z")}


class PsResource:
    """GET /api/ps: the loaded model (the engine keeps one loaded; it never expires)."""

    def __init__(self, engine: EngineSurface) -> None:
        self._engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        status = self._engine.status()
        if status.model is None or status.loading:
            resp.media = {"models": []}
            return
        info = self._engine.resolve(status.model)
        entry = _model_entry(status.model, info, time.time())
        entry.pop("modified_at")
        resp.media = {"models": [{**entry, "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                                  "context_length": info.context_length}]}


class VersionResource:
    """GET /api/version: this server's version."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"version": __version__}
