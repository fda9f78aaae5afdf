"""Map exceptions to HTTP statuses and bodies in the request's protocol shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import falcon
from sqlalchemy.exc import OperationalError

from app.errors import (
    Cancelled,
    ContextTooLong,
    EngineUnavailable,
    Forbidden,
    InvalidModelFile,
    InvalidRequest,
    ModelLoading,
    NotFound,
    Overloaded,
    RequestTooLarge,
    SemanticError,
    StoreBusy,
    Unauthorized,
    UnsupportedMediaType,
)
from app.protocol import anthropic, ollama, openai, responses_output

log = logging.getLogger(__name__)

STATUS: dict[type[SemanticError], int] = {
    ContextTooLong: 400,
    InvalidRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    RequestTooLarge: 413,
    UnsupportedMediaType: 415,
    NotFound: 404,
    StoreBusy: 503,
    Overloaded: 429,
    EngineUnavailable: 503,
    InvalidModelFile: 500,
}

STORE_RETRY_AFTER_S = 5

ErrorRenderer = Callable[[int, str, SemanticError | None], dict[str, Any]]  # status, message, the error if ours
RENDERERS: dict[str, ErrorRenderer] = {"anthropic": lambda status, message, _: anthropic.render_error(status, message),
                                       "openai": lambda status, message, exc: openai.render_error(
                                           status, message, exc.field if isinstance(exc, InvalidRequest) else None),
                                       "responses": responses_output.render_error,
                                       "ollama": lambda status, message, _: ollama.render_error(status, message)}
RENDERERS["direct"] = RENDERERS["anthropic"]  # the direct API answers errors as the Anthropic API does


def status_of(exc: SemanticError) -> int:
    for kind in type(exc).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


def _render(req: falcon.Request, status: int, message: str, exc: SemanticError | None) -> dict[str, Any]:
    return RENDERERS[getattr(req.context, "protocol", "anthropic")](status, message, exc)


def _respond(req: falcon.Request, resp: falcon.Response, status: int, message: str,
             exc: SemanticError | None = None) -> None:
    resp.status = falcon.code_to_http_status(status)
    resp.media = _render(req, status, message, exc)


def handle_semantic(req: falcon.Request, resp: falcon.Response, exc: SemanticError, _params: Any) -> None:
    status = status_of(exc)
    if isinstance(exc, (Overloaded, ModelLoading)):
        resp.set_header("retry-after", str(exc.retry_after_s))
    # Loading is logged as the request's 503 only; a cancelled request (its client left, the
    # server stopping) has its own line from the engine and the request log.
    if status >= 500 and not isinstance(exc, (ModelLoading, Cancelled)):
        log.error("request %s failed: %s", getattr(req.context, "request_id", "-"), exc)
    _respond(req, resp, status, str(exc), exc)


def handle_http(req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError, _params: Any) -> None:
    status = int(exc.status_code)
    message = exc.description or exc.title or "error"
    for name, value in dict(exc.headers or {}).items():
        resp.set_header(name, value)
    _respond(req, resp, status, message)


def handle_unexpected(req: falcon.Request, resp: falcon.Response, exc: Exception, _params: Any) -> None:
    log.exception("unhandled error in request %s", getattr(req.context, "request_id", "-"))
    _respond(req, resp, 500, "internal server error")


def handle_store_down(req: falcon.Request, resp: falcon.Response, exc: OperationalError, _params: Any) -> None:
    """The database is unreachable (PostgreSQL down or restarting, a network cut): nothing
    was written; the client retries. Pooled connections are checked before use, so the
    first request after the database returns succeeds."""
    log.error("request %s: the database is unavailable: %s", getattr(req.context, "request_id", "-"),
              str(exc.orig).strip().splitlines()[0] if exc.orig else exc)
    resp.set_header("retry-after", str(STORE_RETRY_AFTER_S))
    _respond(req, resp, 503, "the database is unavailable; retry shortly")


def add_error_handlers(app: falcon.App) -> None:
    """Most specific handler wins (Falcon picks by exception class)."""
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(OperationalError, handle_store_down)
    app.add_error_handler(falcon.HTTPError, handle_http)
    app.add_error_handler(SemanticError, handle_semantic)
