"""Wiring: build the Falcon app from its dependencies, and serve it on waitress."""

from __future__ import annotations

import logging
import signal
import sys

import falcon

from app.agents.service import AgentService
from app.api.errors import add_error_handlers
from app.api.middleware import AuthMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from app.api.routes import Deps, add_routes
from app.settings import Settings

log = logging.getLogger(__name__)


def create_app(deps: Deps) -> falcon.App:
    """The WSGI application. Tests build it with their own dependencies."""
    app = falcon.App(middleware=[RequestContextMiddleware(), AuthMiddleware(deps.settings.api_key),
                                 BodyLimitMiddleware(deps.settings.max_body_bytes)])
    app.req_options.strip_url_path_trailing_slash = True
    add_routes(app, deps)
    add_error_handlers(app)
    return app


def serve(settings: Settings) -> None:
    """Load BLAS, migrate, load the model, then serve until SIGINT/SIGTERM."""
    from app.engine.blas import blas_in_use, load_fast_blas

    load_fast_blas(settings.blas_library)
    # Imported only now: MLX must see OpenBLAS first.
    import waitress

    from app.catalog.registry import ensure_embedded, model_path
    from app.engine.engine import CacheConfig, Engine
    from app.store.db import make_engine, make_session_factory, upgrade

    upgrade(settings.db_url)
    path = model_path(settings.models_dir, settings.model)
    if not (path / "config.json").exists():
        path = ensure_embedded(settings.models_dir, settings.model)
    sessions = make_session_factory(make_engine(settings.db_url))
    cache = CacheConfig(settings.blocks_dir, sessions, settings.cache_memory_bytes, settings.cache_reuse)
    engine = Engine(path.name, path, cache, dtype=settings.dtype, max_queue=settings.max_queue,
                    prefill_step_size=settings.prefill_step_size, repetition_penalty=settings.repetition_penalty)
    engine.start()
    status = engine.status()
    log.info("model %s on %s, BLAS: %s, cache reuse %s", status.model, status.backend, blas_in_use(),
             "on" if settings.cache_reuse else "OFF")
    app = create_app(Deps(settings, engine, AgentService(sessions), sessions))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("serving on http://%s:%d", settings.host, settings.port)
    try:
        waitress.serve(app, host=settings.host, port=settings.port, threads=settings.threads,
                       ident="semantic", channel_timeout=600, _quiet=True)
    finally:
        engine.stop()
