"""Every URL of the HTTP API, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import falcon
from sqlalchemy.orm import Session, sessionmaker

from app.agents.service import AgentService
from app.api.agents import AgentForkResource, AgentGenerateResource, AgentHistoryResource, AgentResource, AgentsResource
from app.api.api_docs import ApiDocument, DocsResource, OpenApiResource
from app.api.chat import OPENAI
from app.api.completions import COMPLETIONS
from app.api.generation import GenerationResource, parse_for_model
from app.api.health import HealthResource, ModelsResource, RootResource
from app.api.messages import ANTHROPIC, CountTokensResource
from app.api.metrics import Metrics, MetricsResource
from app.api.ollama import (
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    OllamaGenerationResource,
    PsResource,
    ShowResource,
    TagsResource,
    VersionResource,
)
from app.api.page_key import KEY_FORM_PATH, PageKeyResource
from app.api.people_page import FILES as PAGE_FILES
from app.api.people_page import PageFileResource
from app.api.responses import RESPONSES, ResponseResource, ResponsesResource
from app.api.responses_socket import SOCKET, ResponsesSocket
from app.api.status_page import StatusPageResource
from app.settings import Settings
from app.store import jobs

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface


@dataclass(frozen=True)
class Deps:
    settings: Settings
    engine: EngineSurface
    agents: AgentService
    sessions: sessionmaker[Session]


def add_routes(app: falcon.App, deps: Deps) -> None:
    app.add_route("/", RootResource(keyed=bool(deps.settings.api_key)))
    app.add_route(KEY_FORM_PATH, PageKeyResource(deps.settings.api_key))
    app.add_route("/health", HealthResource(deps.engine, deps.agents, deps.settings.effective_server_id))
    app.add_route("/status", StatusPageResource(deps.engine, deps.sessions, deps.settings))
    for path, (name, content_type) in PAGE_FILES.items():
        app.add_route(path, PageFileResource(name, content_type))
    app.add_route("/v1/models", ModelsResource(deps.settings, deps.engine))
    app.add_route("/v1/messages/count_tokens", CountTokensResource(deps.engine, deps.settings.request_options))
    metrics = Metrics(deps.engine, lambda: jobs.run_counts(deps.sessions))
    app.add_route("/metrics", MetricsResource(metrics))
    for path, dialect in (("/v1/messages", ANTHROPIC), ("/v1/chat/completions", OPENAI),
                          ("/v1/completions", COMPLETIONS)):
        app.add_route(path, GenerationResource(dialect, deps.settings, deps.engine, deps.agents, metrics))
    responses = GenerationResource(RESPONSES, deps.settings, deps.engine, deps.agents, metrics)
    socket = ResponsesSocket(deps.agents, GenerationResource(SOCKET, deps.settings, deps.engine, deps.agents, metrics),
                             lambda body: parse_for_model(RESPONSES.parse, body, deps.settings.request_options,
                                                          deps.engine)[0],
                             deps.settings.effective_server_id, deps.settings.max_body_bytes,
                             deps.settings.max_websockets, deps.settings.idle_timeout_s)
    app.add_route("/v1/responses", ResponsesResource(deps.agents, responses, socket.upgrade))
    app.add_route("/v1/responses/{response_id}", ResponseResource(deps.agents))
    for path, dialect in (("/api/chat", OLLAMA_CHAT), ("/api/generate", OLLAMA_GENERATE)):
        generation = GenerationResource(dialect, deps.settings, deps.engine, deps.agents, metrics)
        app.add_route(path, OllamaGenerationResource(generation, deps.engine, chat=dialect is OLLAMA_CHAT))
    app.add_route("/api/tags", TagsResource(deps.settings, deps.engine))
    app.add_route("/api/show", ShowResource(deps.engine))
    app.add_route("/api/ps", PsResource(deps.engine))
    app.add_route("/api/version", VersionResource())
    direct = GenerationResource(ANTHROPIC, deps.settings, deps.engine, deps.agents, metrics)  # protocol "direct"
    app.add_route("/v1/agents", AgentsResource(deps.agents, deps.engine))
    app.add_route("/v1/agents/{agent_id}", AgentResource(deps.agents, deps.engine))
    app.add_route("/v1/agents/{agent_id}/generate",
                  AgentGenerateResource(deps.agents, direct, deps.settings.default_max_tokens))
    app.add_route("/v1/agents/{agent_id}/history", AgentHistoryResource(deps.agents))
    app.add_route("/v1/agents/{agent_id}/fork", AgentForkResource(deps.agents, deps.engine))
    document = ApiDocument(app, bool(deps.settings.api_key))  # every route above, and these two
    app.add_route("/openapi.json", OpenApiResource(document))
    app.add_route("/docs", DocsResource(document))
