"""Per-request context: a request id and the protocol whose error shape applies."""

from __future__ import annotations

import hmac
import uuid

import falcon

from app.errors import RequestTooLarge, Unauthorized

# Probes that must answer without a key (Claude Code's HEAD /, health checks).
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})


def protocol_of(path: str) -> str:
    if path.startswith("/v1/chat/"):
        return "openai"
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return "responses"
    return "anthropic"


class RequestContextMiddleware:
    """A request id, the protocol, and the server's name on every response (``x-semantic-server``:
    which server of a pool answered)."""

    def __init__(self, server_id: str) -> None:
        self._server_id = server_id

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = f"req_{uuid.uuid4().hex[:24]}"
        req.context.protocol = protocol_of(req.path)
        resp.set_header("request-id", req.context.request_id)
        resp.set_header("x-semantic-server", self._server_id)


class AuthMiddleware:
    """Optional API key, accepted as ``x-api-key`` or ``Authorization: Bearer``."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self._key or req.path in OPEN_PATHS:
            return
        bearer = (req.get_header("AUTHORIZATION") or "").removeprefix("Bearer ").strip()
        offered = req.get_header("X-API-KEY") or bearer
        if not offered or not hmac.compare_digest(offered.encode(), self._key):
            raise Unauthorized("invalid or missing API key (send x-api-key or Authorization: Bearer)")


class BodyLimitMiddleware:
    """413 for bodies over the limit, before anything reads them."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.content_length is not None and req.content_length > self._max:
            raise RequestTooLarge(f"request body of {req.content_length} bytes exceeds the limit of {self._max} bytes")
