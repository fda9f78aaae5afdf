"""The request lifecycle every generation endpoint shares, protocol aside.

Parse, resolve the agent, record the request, submit to the engine, then
stream or collect; record the outcome and the new history. A ``Dialect``
says how one protocol parses and renders; the resource does the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import chain
from typing import TYPE_CHECKING, Any, NoReturn

import falcon

from app.agents.identity import AgentKey
from app.agents.service import AgentService, ConversationTarget, StoredReply
from app.api.body import read_json
from app.api.cache_provenance import CACHE_HEADER, header_value
from app.api.errors import status_of
from app.api.metrics import Metrics
from app.api.sse import Frames, SseStream
from app.errors import Cancelled, ContextTooLong, SemanticError
from app.pool.haproxy import REPLY_ID_HEADER
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn, locate_part
from app.settings import Settings
from app.store.history import StoredMessage
from app.types import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    Prompt,
    RequestOptions,
    ReuseReport,
    Started,
    TextDelta,
)

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface, GenerationJob

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0  # a stream waiting this long for its next event (a long prefill) sends a keep-alive


# What history keeps of a message besides its role (OpenAI tool calls and their results).
STORED_KEYS = frozenset({"content", "tool_calls", "tool_call_id"})


def chat_entry(message: dict[str, Any]) -> tuple[str, Any]:
    """A received chat message as history keeps it: (role, content), the content being the
    message without its role when it has OpenAI ``tool_calls`` or ``tool_call_id``. Other
    keys are not kept."""
    rest = {k: v for k, v in message.items() if k in STORED_KEYS}
    return message["role"], message.get("content") if rest.keys() <= {"content"} else rest


def parse_for_model(parse: Callable[[Any, RequestOptions], ParsedTurn], body: Any, options: RequestOptions,
                    engine: EngineSurface) -> tuple[ParsedTurn, str, RequestOptions]:
    """``body`` parsed for the model it names (parsed once more, in the model's own tool
    format, when its chat template has one), that model's name, and the options used.

    Raises:
        InvalidRequest, NotFound.
    """
    parsed = parse(body, options)
    info = engine.resolve(parsed.model)
    if info.tool_syntax is not None:
        options = replace(options, tool_syntax=info.tool_syntax)
        parsed = parse(body, options)
    return parsed, info.name, options


def render_turn(engine: EngineSurface, parsed: ParsedTurn, model: str) -> Prompt:
    """The prompt ``model`` sees for ``parsed``."""
    if parsed.completion is not None:
        return engine.render_completion(parsed.completion.prompt, parsed.completion.suffix, model)
    return engine.render(parsed.messages, parsed.reply_prefix, model, parsed.tool_specs, prefill=parsed.prefill)


@dataclass(frozen=True)
class Dialect:
    """How one protocol speaks. Every function is pure."""

    parse: Callable[[Any, RequestOptions], ParsedTurn]
    named_agent: Callable[[Mapping[str, str], ParsedTurn], AgentKey | None]
    new_id: Callable[[], str]
    # A whole reply's text, built once: the response body, what history keeps, what to store.
    whole_reply: Callable[[str, ParsedTurn, str, Finished], Reply]
    message_digest: Callable[[dict[str, Any]], str]  # a message's identity as the model sees it
    # The stream's bytes, and the Reply it sent once generation finished (before its closing bytes).
    render_stream: Callable[[str, ParsedTurn, Iterator[GenerationEvent]], Frames]
    # An error once the stream started; None: the stream renders it itself, then raises it again.
    render_stream_error: Callable[[int, str], bytes] | None
    error_types: Mapping[int, str]
    history_entry: Callable[[dict[str, Any]], tuple[str, Any]] = chat_entry  # (role, content) history keeps
    stream_media_type: str = "text/event-stream"  # what render_stream's bytes are (Ollama: NDJSON)


@dataclass(frozen=True)
class Turn:
    """What a finished turn needs in order to be recorded."""

    request_id: str
    protocol: str  # req.context.protocol (middleware.protocol_of)
    message_id: str
    target: ConversationTarget
    parsed: ParsedTurn
    prompt: Prompt


class GenerationResource:
    def __init__(self, dialect: Dialect, settings: Settings, engine: EngineSurface, agents: AgentService,
                 metrics: Metrics) -> None:
        self._dialect = dialect
        self._metrics = metrics
        self._settings = settings
        self._engine = engine
        self._agents = agents

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(req, resp, lambda: read_json(req))

    def respond(self, req: falcon.Request, resp: falcon.Response, body: Callable[[], Any],
                agent: AgentKey | Callable[[], AgentKey | None] | None = None) -> ReuseReport | None:
        """Serve one generation whose request body ``body()`` returns; ``agent`` (or what it
        returns once ``body()`` ran) overrides identity resolution (the direct API names it
        in the URL, a Responses API request continues a stored response's agent).

        Returns the turn's cache provenance as its ``x-semantic-cache`` header gave it (None:
        ``source=pending``, a stream whose headers went out before its lease)."""
        turn, job = self._start(req, body, agent)
        resp.set_header(REPLY_ID_HEADER, turn.message_id)  # a pool's router places what continues it
        # waitress tells whether the client hung up (the server keeps reading the socket).
        client_gone = req.env.get("waitress.client_disconnected")
        if turn.parsed.stream:
            events = job.events(client_gone, heartbeat_s=HEARTBEAT_S)
            # NOTE: headers go out when this returns. The lease is taken before prefill, so a
            # stream waits for it (Started), unless the turn waits in the queue for
            # HEARTBEAT_S first (a Heartbeat): then its header says source=pending.
            first = self._first_event(turn, job, events)
            reuse = first.reuse if isinstance(first, (Started, Finished)) else None
            resp.set_header(CACHE_HEADER, header_value(reuse))
            resp.content_type = self._dialect.stream_media_type
            resp.set_header("cache-control", "no-cache")
            resp.stream = SseStream(self._stream(turn, job, chain([first], events)), job.cancel)
            return reuse
        reply, finished = self._collect(turn, job, client_gone)
        resp.set_header(CACHE_HEADER, header_value(finished.reuse))
        resp.media = reply.body
        return finished.reuse

    def _first_event(self, turn: Turn, job: GenerationJob, events: Iterator[GenerationEvent]) -> GenerationEvent:
        """A stream's first event, before its status line: a failure is still an HTTP error."""
        try:
            return next(events)
        except SemanticError as exc:
            self._agents.fail(turn.request_id, turn.target, "api_error", str(exc))
            raise
        except BaseException:
            job.cancel()
            raise

    def _start(self, req: falcon.Request, body: Callable[[], Any],
               agent: AgentKey | Callable[[], AgentKey | None] | None) -> tuple[Turn, GenerationJob]:
        request_id, protocol = req.context.request_id, req.context.protocol
        job: GenerationJob | None = None
        try:
            received = body()
            parsed, model, prompt, target = self._prepare(req, received, agent() if callable(agent) else agent)
            self._agents.begin(request_id, protocol=protocol, model=parsed.model, served_model=model,
                               stream=parsed.stream, n_input_tokens=prompt.n_tokens)
            job = self._engine.submit(GenerationRequest(
                request_id, prompt, parsed.sampling, target.agent.agent_id, target.conversation_id,
                whole_blocks=parsed.cache_mode == "prefix", persist=parsed.ttl_seconds != 0,
                hot_ttl_s=parsed.hot_ttl_seconds, model=model, arrived_at=req.context.arrived))
            self._agents.accept(request_id, target, parsed.snapshot, ttl_seconds=parsed.ttl_seconds,
                                hot_ttl_seconds=parsed.hot_ttl_seconds)
        except SemanticError as exc:
            if job is not None:  # submitted, then the store refused to record it
                job.cancel()
            error_type = self._dialect.error_types.get(status_of(exc), "api_error")
            self._agents.reject(request_id, protocol, error_type, str(exc))
            self._metrics.rejected(protocol)
            raise
        return Turn(request_id, protocol, self._dialect.new_id(), target, parsed, prompt), job

    def _prepare(self, req: falcon.Request, body: Any,
                 agent: AgentKey | None) -> tuple[ParsedTurn, str, Prompt, ConversationTarget]:
        """Parse, choose the model, find the conversation, render the prompt the model
        sees (with the conversation's pinned snapshot); a prompt beyond the context is
        parsed again without optional sections when ``fit_prompts`` allows.

        Raises:
            InvalidRequest, ContextTooLong, NotFound.
        """
        parsed, model, options = parse_for_model(self._dialect.parse, body, self._settings.request_options,
                                                 self._engine)
        target = self._agents.resolve(agent or self._dialect.named_agent(req.headers, parsed),
                                      parsed.system_digest, parsed.message_digests)
        req.context.agent = target.agent.agent_id
        parsed = parsed.with_snapshot(target.snapshot)
        try:
            prompt = render_turn(self._engine, parsed, model)
            self._engine.check_fits(prompt, model)
        except ContextTooLong as too_long:
            if not self._settings.fit_prompts:
                raise
            fitted = self._dialect.parse(body, replace(options, fit=True)).with_snapshot(target.snapshot)
            if fitted.messages == parsed.messages:
                raise
            parsed, prompt = fitted, render_turn(self._engine, fitted, model)
            log.info("request %s: prompt of %d tokens fitted to the context: optional sections dropped, %d left",
                     req.context.request_id, too_long.n_tokens, prompt.n_tokens)
            self._engine.check_fits(prompt, model)
        return parsed, model, prompt, target

    def _end_cancelled(self, turn: Turn, finished: Finished) -> NoReturn:
        """A turn cancelled before its reply ended (the server stopping, or its client gone):
        recorded as cancelled with no history, and its client (if still there) told so in the
        protocol's error shape: a reply that looked finished (``end_turn``) was taken as one.

        Raises:
            Cancelled: always.
        """
        self._agents.complete(turn.request_id, turn.target, [], finished, finished.reuse)
        self._metrics.observe(turn.protocol, finished)
        _log_turn(turn, finished, finished.reuse)
        raise Cancelled("the request was cancelled before its reply ended (the server is stopping, or its client "
                        "left); nothing of it was stored")

    def _record(self, turn: Turn, reply: Reply, finished: Finished) -> None:
        parsed = turn.parsed
        # A prefilled reply (a final assistant message) and its continuation are one message (the reply's).
        received = parsed.raw_messages[:-1] if parsed.prefill else parsed.raw_messages
        entry = self._dialect.history_entry
        messages = [StoredMessage(*entry(m), digest) for m, digest in zip(received, parsed.message_digests)]
        messages += [StoredMessage(*entry(r), self._dialect.message_digest(r)) for r in reply.history]
        reuse = finished.reuse
        if reuse is not None and reuse.offset is not None:
            reuse = replace(reuse, part=locate_part(parsed.parts, turn.prompt.text, reuse.offset))
        body = reply.stored
        stored = StoredReply(turn.message_id, body.get("previous_response_id"), body) if body is not None else None
        self._agents.complete(turn.request_id, turn.target, messages, finished, reuse, stored)
        self._metrics.observe(turn.protocol, finished)
        _log_turn(turn, finished, reuse)

    def _collect(self, turn: Turn, job: GenerationJob,
                 client_gone: Callable[[], bool] | None) -> tuple[Reply, Finished]:
        parts: list[str] = []
        try:
            for event in job.events(client_gone):
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    if event.stop_reason == "cancelled":
                        self._end_cancelled(turn, event)
                    reply = self._dialect.whole_reply(turn.message_id, turn.parsed, "".join(parts), event)
                    self._record(turn, reply, event)
                    return reply, event
        except Cancelled:
            raise
        except SemanticError as exc:
            self._agents.fail(turn.request_id, turn.target, "api_error", str(exc))
            raise
        raise AssertionError("engine events ended without Finished")

    def _stream(self, turn: Turn, job: GenerationJob, events: Iterator[GenerationEvent]) -> Iterator[bytes]:
        finished: list[Finished] = []

        def observed() -> Iterator[GenerationEvent]:
            for event in events:
                if isinstance(event, Finished):
                    if event.stop_reason == "cancelled":
                        self._end_cancelled(turn, event)
                    finished.append(event)
                yield event

        rendered = self._dialect.render_stream(turn.message_id, turn.parsed, observed())
        try:
            out = next(rendered, None)
            while out is not None:
                if isinstance(out, Reply):  # what the stream sent, before its closing bytes
                    try:
                        self._record(turn, out, finished[-1])
                    except SemanticError as exc:  # the renderer ends the stream as its protocol does, or raises
                        out = rendered.throw(exc)
                        continue
                else:
                    yield out
                out = next(rendered, None)
        except Cancelled as exc:  # recorded as cancelled; told in the protocol's error shape, not end_turn
            if self._dialect.render_stream_error is not None:
                yield self._dialect.render_stream_error(status_of(exc), str(exc))
        except SemanticError as exc:
            # The status line is gone; report in-stream, as the protocols do.
            log.error("stream %s failed: %s", turn.request_id, exc)
            self._agents.fail(turn.request_id, turn.target, "api_error", str(exc))
            if self._dialect.render_stream_error is not None:
                yield self._dialect.render_stream_error(status_of(exc), str(exc))
        except GeneratorExit:
            rendered.close()
            job.cancel()
            self._agents.fail(turn.request_id, turn.target, "cancelled", "client disconnected", status="cancelled")
            raise


def _log_turn(turn: Turn, finished: Finished, reuse: ReuseReport | None) -> None:
    """One line per request; a second one when less than the whole prompt came from cache."""
    decode_s = finished.total_s - finished.ttft_s
    rate = (finished.n_output_tokens - 1) / decode_s if finished.n_output_tokens > 1 and decode_s > 0 else 0.0
    agent, conversation = turn.target.agent.agent_id, turn.target.conversation_id
    log.info("request %s agent %s conversation %s: prompt %d tokens (cached %d, new %d), output %d, "
             "ttft %.2f s (queue %.2f, restore %.2f, prefill %.2f), %.1f tok/s%s, %s, %s", turn.request_id, agent,
             conversation, finished.n_prompt_tokens, finished.n_cached_tokens,
             finished.n_prompt_tokens - finished.n_cached_tokens, finished.n_output_tokens, finished.ttft_s,
             finished.queue_s, finished.restore_s, finished.prefill_s, rate,
             f" (drafts {finished.n_draft_accepted}/{finished.n_draft_tokens} kept)" if finished.n_draft_tokens else "",
             reuse.reason if reuse else "-", finished.stop_reason)
    if reuse is not None and reuse.reason not in ("extend", "exact"):
        where = (f"; stored text parts from the prompt at char {reuse.offset} in {reuse.part}: "
                 f"stored {reuse.stored!r}, new {reuse.new!r}") if reuse.offset is not None else ""
        log.info("request %s cache %s: %d of %d prompt tokens reused (%d chars)%s", turn.request_id, reuse.reason,
                 finished.n_cached_tokens, finished.n_prompt_tokens, reuse.n_chars, where)
