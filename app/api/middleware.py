"""Per-request context: a request id and the protocol whose error shape applies."""

from __future__ import annotations

import uuid

import falcon


def protocol_of(path: str) -> str:
    if path.startswith("/v1/chat/"):
        return "openai"
    return "anthropic"


class RequestContextMiddleware:
    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = f"req_{uuid.uuid4().hex[:24]}"
        req.context.protocol = protocol_of(req.path)
        resp.set_header("request-id", req.context.request_id)
