"""POST /v1/messages: the Anthropic Messages API (Claude Code's endpoint)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, TYPE_CHECKING

import falcon

from app.agents.identity import AgentKey, anthropic_agent, new_agent
from app.agents.service import AgentService
from app.api.body import read_json
from app.api.errors import status_of
from app.api.sse import SseStream, frame
from app.cache.hashing import BLOCK_TOKENS
from app.errors import NotFound, SemanticError
from app.protocol import anthropic
from app.settings import Settings
from app.types import Finished, GenerationRequest, TextDelta

if TYPE_CHECKING:
    from app.engine.engine import Engine
    from app.engine.runner import Job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """What a finished turn needs in order to be recorded."""

    request_id: str
    agent: AgentKey
    parsed: anthropic.MessagesRequest


class MessagesResource:
    def __init__(self, settings: Settings, engine: Engine, agents: AgentService) -> None:
        self._settings = settings
        self._engine = engine
        self._agents = agents

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request_id = req.context.request_id
        try:
            parsed = anthropic.parse_request(read_json(req), max_output_tokens=self._settings.max_output_tokens)
            self._check_model(parsed.model)
            prompt = self._engine.render(parsed.messages)
            agent = (anthropic_agent(req.headers, parsed.session_id)
                     or self._agents.resume_by_content(self._engine.loaded.fingerprint, prompt.token_ids,
                                                       prompt.text, BLOCK_TOKENS)
                     or new_agent())
            # The agent row exists before the engine can store a cache for it.
            self._agents.begin(request_id, agent, protocol="anthropic", model=parsed.model,
                               served_model=self._engine.loaded.name, stream=parsed.stream,
                               n_input_tokens=prompt.n_tokens)
            job = self._engine.submit(GenerationRequest(request_id, prompt, parsed.sampling, agent.agent_id))
        except SemanticError as exc:
            status = status_of(exc)
            self._agents.reject(request_id, "anthropic", anthropic.ERROR_TYPES.get(status, "api_error"), str(exc))
            raise
        turn = Turn(request_id, agent, parsed)
        message_id = anthropic.new_message_id()
        if parsed.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("cache-control", "no-cache")
            resp.stream = SseStream(self._stream(turn, job, message_id), job.cancel)
            return
        text, finished = self._collect(turn, job)
        resp.media = anthropic.render_message(message_id, parsed.model, text, finished)

    def _check_model(self, model: str) -> None:
        if model != self._engine.loaded.name and not self._settings.map_unknown_models:
            raise NotFound(f"model: {model!r} is not served here (serving {self._engine.loaded.name!r})")

    def _record(self, turn: Turn, text: str, finished: Finished) -> None:
        reply = ("assistant", [{"type": "text", "text": text}])
        received = [(m["role"], m["content"]) for m in turn.parsed.raw_messages]
        self._agents.complete(turn.request_id, turn.agent, received, reply, finished)

    def _collect(self, turn: Turn, job: Job) -> tuple[str, Finished]:
        parts: list[str] = []
        try:
            for event in job.events():
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

    def _stream(self, turn: Turn, job: Job, message_id: str) -> Iterator[bytes]:
        parts: list[str] = []

        def observed() -> Iterator[Any]:
            for event in job.events():
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    self._record(turn, "".join(parts), event)
                yield event

        try:
            for name, data in anthropic.render_events(message_id, turn.parsed.model, observed()):
                yield frame(name, data)
        except SemanticError as exc:
            # The status line is gone; report in-stream, as Anthropic does.
            log.error("stream %s failed: %s", turn.request_id, exc)
            self._agents.fail(turn.request_id, "api_error", str(exc))
            yield frame("error", anthropic.render_error(status_of(exc), str(exc)))
        except GeneratorExit:
            job.cancel()
            self._agents.fail(turn.request_id, "cancelled", "client disconnected", status="cancelled")
            raise
