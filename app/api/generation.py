"""The request lifecycle every generation endpoint shares, protocol aside.

Parse, resolve the agent, record the request, submit to the engine, then
stream or collect; record the outcome and the new history. A ``Dialect``
says how one protocol parses and renders; the resource does the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import falcon

from app.agents.identity import AgentKey, new_agent
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.errors import status_of
from app.api.metrics import Metrics
from app.api.sse import SseStream
from app.cache.hashing import BLOCK_TOKENS
from app.errors import NotFound, SemanticError
from app.protocol.turn import ParsedTurn
from app.settings import Settings
from app.types import Finished, GenerationEvent, GenerationRequest, RequestDefaults, TextDelta

if TYPE_CHECKING:
    from app.engine.engine import Engine
    from app.engine.runner import Job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dialect:
    """How one protocol speaks. Every function is pure."""

    name: str  # anthropic / openai: the requests.protocol column
    parse: Callable[[Any, RequestDefaults], ParsedTurn]
    named_agent: Callable[[Mapping[str, str], ParsedTurn], AgentKey | None]
    new_id: Callable[[], str]
    render_message: Callable[[str, ParsedTurn, str, Finished], dict[str, Any]]
    reply_content: Callable[[str, ParsedTurn, str], Any]  # the reply as history stores it
    render_stream: Callable[[str, ParsedTurn, Iterator[GenerationEvent]], Iterator[bytes]]
    render_stream_error: Callable[[int, str], bytes]
    error_types: Mapping[int, str]


def _stored_content(message: dict[str, Any]) -> Any:
    """A received message as history keeps it: its content, or the message
    without its role when it carries more (OpenAI ``tool_calls``, ``tool_call_id``)."""
    rest = {k: v for k, v in message.items() if k != "role"}
    return message.get("content") if rest.keys() <= {"content"} else rest


@dataclass(frozen=True)
class Turn:
    """What a finished turn needs in order to be recorded."""

    request_id: str
    message_id: str
    agent: AgentKey
    parsed: ParsedTurn


class GenerationResource:
    def __init__(self, dialect: Dialect, settings: Settings, engine: Engine, agents: AgentService,
                 metrics: Metrics) -> None:
        self._dialect = dialect
        self._metrics = metrics
        self._settings = settings
        self._engine = engine
        self._agents = agents

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(req, resp, lambda: read_json(req))

    def respond(self, req: falcon.Request, resp: falcon.Response, body: Callable[[], Any],
                agent: AgentKey | None = None) -> None:
        """Serve one generation whose request body ``body()`` returns; ``agent``
        overrides identity resolution (the direct API names it in the URL)."""
        turn, job = self._start(req, body, agent)
        # waitress tells whether the client hung up (the server keeps reading the socket).
        client_gone = req.env.get("waitress.client_disconnected")
        if turn.parsed.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("cache-control", "no-cache")
            resp.stream = SseStream(self._stream(turn, job, client_gone), job.cancel)
            return
        text, finished = self._collect(turn, job, client_gone)
        resp.media = self._dialect.render_message(turn.message_id, turn.parsed, text, finished)

    def _start(self, req: falcon.Request, body: Callable[[], Any], agent: AgentKey | None) -> tuple[Turn, Job]:
        request_id = req.context.request_id
        try:
            parsed = self._dialect.parse(body(), self._settings.request_defaults)
            self._check_model(parsed.model)
            prompt = self._engine.render(parsed.messages, parsed.reply_start)
            agent = (agent or self._dialect.named_agent(req.headers, parsed)
                     or self._agents.resume_by_content(self._engine.loaded.fingerprint, prompt.token_ids,
                                                       prompt.text, BLOCK_TOKENS)
                     or new_agent())
            # The agent row exists before the engine can store a cache for it.
            self._agents.begin(request_id, agent, protocol=self._dialect.name, model=parsed.model,
                               served_model=self._engine.loaded.name, stream=parsed.stream,
                               n_input_tokens=prompt.n_tokens, ttl_seconds=parsed.ttl_seconds,
                               hot_ttl_seconds=parsed.hot_ttl_seconds)
            job = self._engine.submit(GenerationRequest(
                request_id, prompt, parsed.sampling, agent.agent_id,
                whole_blocks=parsed.cache_mode == "prefix", persist=parsed.ttl_seconds != 0,
                hot_ttl_s=parsed.hot_ttl_seconds))
        except SemanticError as exc:
            error_type = self._dialect.error_types.get(status_of(exc), "api_error")
            self._agents.reject(request_id, self._dialect.name, error_type, str(exc))
            self._metrics.rejected(self._dialect.name)
            raise
        return Turn(request_id, self._dialect.new_id(), agent, parsed), job

    def _check_model(self, model: str) -> None:
        if model != self._engine.loaded.name and not self._settings.map_unknown_models:
            raise NotFound(f"model: {model!r} is not served here (serving {self._engine.loaded.name!r})")

    def _record(self, turn: Turn, text: str, finished: Finished) -> None:
        reply = ("assistant", self._dialect.reply_content(turn.message_id, turn.parsed, text))
        received = [(m["role"], _stored_content(m)) for m in turn.parsed.raw_messages]
        self._agents.complete(turn.request_id, turn.agent, received, reply, finished)
        self._metrics.observe(self._dialect.name, finished)

    def _collect(self, turn: Turn, job: Job, client_gone: Callable[[], bool] | None) -> tuple[str, Finished]:
        parts: list[str] = []
        try:
            for event in job.events(client_gone):
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    text = "".join(parts)
                    self._record(turn, text, event)
                    return text, event
        except SemanticError as exc:
            self._agents.fail(turn.request_id, "api_error", str(exc))
            raise
        raise AssertionError("engine events ended without Finished")

    def _stream(self, turn: Turn, job: Job, client_gone: Callable[[], bool] | None) -> Iterator[bytes]:
        parts: list[str] = []

        def observed() -> Iterator[GenerationEvent]:
            for event in job.events(client_gone):
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    self._record(turn, "".join(parts), event)
                yield event

        try:
            yield from self._dialect.render_stream(turn.message_id, turn.parsed, observed())
        except SemanticError as exc:
            # The status line is gone; report in-stream, as the protocols do.
            log.error("stream %s failed: %s", turn.request_id, exc)
            self._agents.fail(turn.request_id, "api_error", str(exc))
            yield self._dialect.render_stream_error(status_of(exc), str(exc))
        except GeneratorExit:
            job.cancel()
            self._agents.fail(turn.request_id, "cancelled", "client disconnected", status="cancelled")
            raise
