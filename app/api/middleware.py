"""Request middleware: each request's id and protocol, the request log, the API key, the body limit."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Literal

import falcon

from app.api.page_key import KEY_FORM_PATH, cookie_admits
from app.api.people_page import FILES as PAGE_FILES
from app.errors import RequestTooLarge, Unauthorized
from app.http_server import ARRIVED

log = logging.getLogger(__name__)

# Probes that must answer without a key (Claude Code's HEAD /, health checks).
PROBES = frozenset({"/", "/health", "/metrics"})
# What answers without a key: the probes, and the people page's files (they hold no data; its
# script sends the key the user enters with each API call), and the key form's target.
OPEN_PATHS = PROBES | frozenset(PAGE_FILES) | {KEY_FORM_PATH}


Protocol = Literal["anthropic", "openai", "responses", "direct", "ollama"]


def protocol_of(path: str) -> Protocol:
    """The protocol a request to ``path`` speaks, decided here only (``req.context.protocol``):
    its error shape (api/errors.py; the direct API's is Anthropic's), the ``requests.protocol``
    column and the ``protocol`` label of the request metrics, its errors in the OpenAPI document."""
    if path.startswith("/v1/chat/") or path == "/v1/completions":
        return "openai"
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return "responses"
    if path == "/v1/agents" or path.startswith("/v1/agents/"):
        return "direct"
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic"


def loggable(value: str | None) -> str | None:
    """``value`` with every character that is not printable (newlines, carriage returns, other
    control and separator characters) written as its Python escape: what a client sent
    (``%0A`` in a URL decodes to a newline) can never start a line of its own in the log."""
    if value is None or value.isprintable():
        return value
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)


class RequestContextMiddleware:
    """Each request's id (the ``request-id`` header) and protocol, the server's name on every
    response (``x-semantic-server``: which server of a pool answered), and one log line a
    request once its status is known, errors included: method, path, status, request id,
    agent (where the URL or the body named or matched one) and client (its User-Agent).
    Probes that succeed or say the server is not ready yet (``PROBES``: health checkers,
    scrapers; 503 while the model loads) are logged at DEBUG only.
    ``req.context.arrived`` (``time.perf_counter()``) is when a generation's time to first token
    starts: when the server read the request's first byte (``http_server.ARRIVED``), or, under
    a WSGI server that does not say, now (this middleware runs first)."""

    def __init__(self, server_id: str) -> None:
        self._server_id = server_id

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.arrived = req.env.get(ARRIVED) or time.perf_counter()
        req.context.request_id = f"req_{uuid.uuid4().hex[:24]}"
        req.context.protocol = protocol_of(req.path)
        req.context.agent = None  # set by the URL (below) or by identity resolution (generation)
        resp.set_header("request-id", req.context.request_id)
        resp.set_header("x-semantic-server", self._server_id)

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         params: dict[str, str]) -> None:
        req.context.agent = params.get("agent_id")

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         req_succeeded: bool) -> None:
        fields = {"method": loggable(req.method), "path": loggable(req.path), "status": resp.status_code,
                  "request_id": req.context.request_id, "agent": loggable(req.context.agent),
                  "client": loggable(req.user_agent)}
        # A probe's 503 while the model loads is its expected answer, asked every few seconds.
        probe = req.path in PROBES and (resp.status_code < 400 or resp.status_code == 503)
        log.log(logging.DEBUG if probe else logging.INFO, "%s %s %d request %s agent %s client %r",
                *fields.values(), extra=fields)


class AuthMiddleware:
    """Optional API key, accepted as ``x-api-key`` or ``Authorization: Bearer``; a browser
    reading a page may show the page cookie instead (``page_key.py``)."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        # An open path answers without the key; ``authorized`` tells it whether to show what only
        # the key's holder may see (/health: the agents in flight).
        req.context.authorized = self._admits(req)
        if not req.context.authorized and req.path not in OPEN_PATHS:
            raise Unauthorized("invalid or missing API key (send x-api-key or Authorization: Bearer)")

    def _admits(self, req: falcon.Request) -> bool:
        if not self._key or cookie_admits(req, self._key):
            return True
        bearer = (req.get_header("AUTHORIZATION") or "").removeprefix("Bearer ").strip()
        offered = req.get_header("X-API-KEY") or bearer
        return bool(offered) and hmac.compare_digest(offered.encode(), self._key)


class BodyLimitMiddleware:
    """413 for bodies over the limit, before anything reads them."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.content_length is not None and req.content_length > self._max:
            raise RequestTooLarge(f"request body of {req.content_length} bytes exceeds the limit of {self._max} bytes")
