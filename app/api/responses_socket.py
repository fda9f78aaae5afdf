"""The Responses API's WebSocket transport: GET /v1/responses with an upgrade, as Codex's
``supports_websockets`` provider option uses it.

waitress (WSGI) cannot hold an upgraded connection, so the upgrade request goes through the
Falcon app like any request (API key, origin and host checks, request id); then it takes its
socket over from waitress (``app.http_server.TAKE_SOCKET``), answers 101 itself and serves
the connection on a thread of its own with the ``websockets`` library's threaded connection.
Same port, same checks, no second server.

Each ``response.create`` message carries a POST /v1/responses body (``stream`` implied) and
is served by ``ResponsesResource.respond``: the same parsing, generation, recording and
event rendering as HTTP, each event one JSON text message instead of an SSE frame.
``previous_response_id`` names a stored response or the connection's latest response, kept
in memory on the connection (so it continues with ``store: false``, as Codex sends it): a
turn sends only its new input. ``generate: false`` is a warm-up: parsed and answered with
``response.created`` and ``response.completed`` (no output, nothing run); its id continues
from its input. ``response.processed`` (newer Codex versions: the client is done with a
response) is taken without an answer. Any other message gets an ``error`` event (the HTTP
error body with ``type: "error"`` and the HTTP ``status``); the connection and its latest
response stay.

What a connection may cost is bounded: at most ``max_websockets`` are open (an upgrade beyond
it is refused with 429, before the socket is taken), one is closed after ``idle_timeout_s``
without a message, and it reads ahead of the message being served by one frame at most (the
library's default queue of 16 let one client make the server hold 16 messages of
``max_body_bytes`` each); a message's text is freed once it is parsed.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import falcon
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request
from websockets.protocol import OPEN
from websockets.server import ServerProtocol
from websockets.sync.connection import Connection

from app.agents.service import AgentService
from app.api.body import parse_json
from app.api.errors import status_of
from app.api.generation import GenerationResource
from app.api.middleware import RequestContextMiddleware
from app.api.responses import RESPONSES, continued
from app.api.sse import Frames, SseStream, framed
from app.errors import InvalidRequest, Overloaded, SemanticError
from app.http_server import TAKE_SOCKET
from app.protocol import responses, responses_output
from app.protocol.turn import ParsedTurn
from app.store.responses import ResponsePoint
from app.types import GenerationEvent

if TYPE_CHECKING:
    from app.api.responses import ResponsesResource

log = logging.getLogger(__name__)

DONE = frozenset({"response.completed", "response.incomplete"})  # a generated response's last event
READ_AHEAD_FRAMES = 0  # frames queued beyond the message being served, past which reading pauses
IDLE_CLOSE_CODE = 1000  # a normal closure: the client reconnects for its next turn


class TooManyWebSockets(Overloaded):
    """``max_websockets`` connections are open."""

    retry_after_s = 5


def _messages(response_id: str, parsed: ParsedTurn, events: Iterator[GenerationEvent]) -> Frames:
    return framed(responses_output.render_events(response_id, parsed, events),
                  lambda event: json.dumps(event, separators=(",", ":")).encode())


# The Responses dialect with each event a WebSocket message's JSON instead of an SSE frame.
SOCKET = replace(RESPONSES, render_stream=_messages, stream_media_type="application/json")


def error_event(status: int, message: str, exc: SemanticError | None = None) -> dict[str, Any]:
    """An ``error`` message: the HTTP error body with its status (Codex reads ``status``)."""
    return {"type": "error", "status": status, **responses_output.render_error(status, message, exc)}


class ResponsesSocket:
    """Upgrades GET /v1/responses; each connection is served by a ``_Session`` on its own thread."""

    def __init__(self, agents: AgentService, generation: GenerationResource, parse: Callable[[Any], ParsedTurn],
                 server_id: str, max_message_bytes: int, max_open: int, idle_timeout_s: float) -> None:
        """``generation`` renders with ``SOCKET``; ``parse`` parses a body for its model (a warm-up)."""
        self.agents = agents
        self.generation = generation
        self.parse = parse
        self.context = RequestContextMiddleware(server_id)  # each message's request id, as HTTP's
        self.idle_timeout_s = idle_timeout_s
        self._max_bytes = max_message_bytes
        self._max_open = max_open
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open_count(self) -> int:
        """Connections open now."""
        return self._open

    def _claim(self) -> None:
        with self._lock:
            if self._open >= self._max_open:
                raise TooManyWebSockets(f"{self._max_open} WebSocket connections are open (max_websockets): "
                                        "retry later, or use POST /v1/responses")
            self._open += 1

    def release(self) -> None:
        """One connection has closed."""
        with self._lock:
            self._open -= 1

    def upgrade(self, req: falcon.Request, resp: falcon.Response, resource: ResponsesResource) -> None:
        """Answer the upgrade (101) on the socket taken from waitress and start its session.

        Raises:
            InvalidRequest: not a valid WebSocket upgrade, or a server that cannot hand its
                socket over (falcon's test client).
            TooManyWebSockets: ``max_websockets`` are open.
        """
        handshake = ServerProtocol()
        response = handshake.accept(Request(req.relative_uri, Headers(req.headers)))
        if response.status_code != 101:
            raise InvalidRequest(f"GET /v1/responses is the WebSocket transport: {response.body.decode().strip()}",
                                 "upgrade")
        take = req.env.get(TAKE_SOCKET)
        if take is None:
            raise InvalidRequest("this server cannot hand a connection over to a WebSocket", "upgrade")
        self._claim()
        sock: socket.socket | None = None
        try:
            sock = take()
            sock.sendall(response.serialize())
            connection = Connection(sock, ServerProtocol(state=OPEN, max_size=self._max_bytes),
                                    max_queue=READ_AHEAD_FRAMES)
            environ = {k: v for k, v in req.env.items() if k not in (TAKE_SOCKET, "wsgi.input")}
            environ["waitress.client_disconnected"] = lambda: connection.protocol.state is not OPEN
            session = _Session(connection, environ, resource, self)
            threading.Thread(target=session.run, name=f"semantic-ws-{connection.id.hex[:8]}", daemon=True).start()
        except BaseException:  # no session owns the socket: it is closed and not counted
            if sock is not None:
                sock.close()
            self.release()
            raise
        resp.status = falcon.code_to_http_status(101)
        log.info("request %s: WebSocket %s open (Responses API)", req.context.request_id, connection.id.hex[:12])


class _Session:
    """One connection: its messages in order, and its latest response."""

    def __init__(self, connection: Connection, environ: dict[str, Any], resource: ResponsesResource,
                 socket: ResponsesSocket) -> None:
        self._connection = connection
        self._environ = environ
        self._resource = resource
        self._socket = socket
        self._latest: ResponsePoint | None = None
        self.name = connection.id.hex[:12]

    def run(self) -> None:
        try:
            while True:
                self._serve(self._receive())  # NOTE: no reference to a message outlives its parse
        except ConnectionClosed:
            pass  # Codex exits without a close frame
        except Exception:
            log.exception("WebSocket %s failed", self.name)
        finally:
            self._connection.close()
            self._socket.release()
            log.info("WebSocket %s closed", self.name)

    def _receive(self) -> str | bytes:
        """The next message.

        Raises:
            ConnectionClosed: the client closed, or sent nothing for ``idle_timeout_s`` (then
                this closes it).
        """
        try:
            return self._connection.recv(timeout=self._socket.idle_timeout_s)
        except TimeoutError:
            log.info("WebSocket %s: no message for %g s (idle_timeout_s): closing", self.name,
                     self._socket.idle_timeout_s)
            self._connection.close(IDLE_CLOSE_CODE, "idle")
            raise self._connection.protocol.close_exc from None

    def _lookup(self, response_id: str) -> ResponsePoint:
        if self._latest is not None and self._latest.response_id == response_id:
            return self._latest
        return self._socket.agents.response_point(response_id)

    def _request(self) -> tuple[falcon.Request, falcon.Response]:
        """A message's request (the upgrade's headers, a new request id; the message is its body,
        parsed by the caller) and its response."""
        env = {**self._environ, "REQUEST_METHOD": "POST", "CONTENT_TYPE": "application/json",
               "CONTENT_LENGTH": "0", "wsgi.input": io.BytesIO()}
        req, resp = falcon.Request(env), falcon.Response()
        self._socket.context.process_request(req, resp)
        return req, resp

    def _serve(self, message: str | bytes) -> None:
        req, resp = self._request()
        try:
            if isinstance(message, bytes):
                raise InvalidRequest("binary messages are not accepted: send each event as JSON text", "type")
            body = parse_json(message)
            del message  # NOTE: a large message's text is freed before its turn runs
            kind = body.get("type") if isinstance(body, dict) else None
            if kind == "response.processed":  # newer Codex: the client is done with a response; no answer
                return
            if kind != "response.create":
                raise InvalidRequest(f"unknown message type {kind!r}: this server accepts response.create", "type")
            generate = body.get("generate", True) is not False
            body = {k: v for k, v in body.items() if k not in ("type", "generate")}
            if generate:
                self._generate(req, resp, {**body, "stream": True})
            else:
                self._warm_up(req, body)
        except SemanticError as exc:
            status = status_of(exc)
            log.info("WebSocket %s: request %s refused (%d): %s", self.name, req.context.request_id, status, exc)
            self._send(error_event(status, str(exc), exc))

    def _generate(self, req: falcon.Request, resp: falcon.Response, body: dict[str, Any]) -> None:
        resolved, agent = self._resource.respond(req, resp, self._socket.generation, self._lookup, lambda: body)
        log.info("WebSocket %s: request %s agent %s", self.name, req.context.request_id, req.context.agent)
        final: dict[str, Any] | None = None
        stream = resp.stream
        assert isinstance(stream, SseStream)  # a streamed answer (stream: true)
        try:
            for payload in stream:
                event = json.loads(payload)
                self._connection.send(payload.decode())
                if event["type"] in DONE:
                    final = event["response"]
        finally:
            stream.close()  # cancels generation if the connection went away
        if final is not None:
            output = responses_output.kept_items(final["output"])  # as history keeps it
            self._latest = ResponsePoint(final["id"], req.context.agent or "", "", agent.thread if agent else None,
                                         (*responses.input_items(resolved.get("input", "")), *output))

    def _warm_up(self, req: falcon.Request, body: dict[str, Any]) -> None:
        resolved, agent = continued(body, req.headers, self._lookup)
        parsed = self._socket.parse(resolved)
        response_id = responses_output.new_response_id()
        for event in responses_output.render_warmup(response_id, parsed):
            self._send(event)
        self._latest = ResponsePoint(response_id, agent.agent_id if agent else "", "", agent.thread if agent else None,
                                     tuple(responses.input_items(resolved.get("input", ""))))
        log.info("WebSocket %s: request %s warm-up %s", self.name, req.context.request_id, response_id)

    def _send(self, event: dict[str, Any]) -> None:
        self._connection.send(json.dumps(event, separators=(",", ":")))

