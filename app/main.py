"""Wiring: build the Falcon app from its dependencies, and serve it on waitress."""

from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import falcon

from app import __version__, home_lock, huge_pages
from app.agents.service import AgentService
from app.api.errors import add_error_handlers
from app.api.local_only import LocalOnlyMiddleware, exposure_problem, is_loopback
from app.api.middleware import AuthMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from app.api.routes import Deps, add_routes
from app.errors import ConfigError, EngineUnavailable, SemanticError
from app.http_server import HEAD_TIMEOUT_S, make_server
from app.interrupts import CtrlC
from app.open_files import allow_open_files, import_mlx_lm, open_files_needed
from app.settings import Settings
from app.worker_process import start_worker, stop_worker

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.cache.janitor import Janitor
    from app.cache.shared_tier import S3Tier
    from app.catalog.registry import Catalog
    from app.engine.engine import Engine

log = logging.getLogger(__name__)
_LOADED_AT = time.monotonic()


def create_app(deps: Deps) -> falcon.App:
    """The WSGI application. Tests build it with their own dependencies."""
    settings = deps.settings
    app = falcon.App(middleware=[  # type: ignore[arg-type]  # falcon's types want one middleware kind
        RequestContextMiddleware(settings.effective_server_id),
        LocalOnlyMiddleware(settings.host, settings.allowed_origins, settings.allowed_hosts),
        AuthMiddleware(settings.api_key),
        BodyLimitMiddleware(settings.max_body_bytes),
    ])
    app.req_options.strip_url_path_trailing_slash = True
    add_routes(app, deps)
    add_error_handlers(app)
    return app


def serve(settings: Settings) -> None:
    """Take the home's serve lock, load BLAS, migrate, bind the port, then load the model while answering
    ``/health`` with "loading"; serve until SIGINT/SIGTERM.

    Raises:
        ConfigError: another server holds the home (``home_lock``), the port cannot be
            bound (in use, not allowed), a configured model is neither installed nor
            embedded, or a non-loopback address would be served without api_key
            (``local_only.exposure_problem``).
        EngineUnavailable: the model failed to load.
    """
    problem = exposure_problem(settings.host, settings.api_key, settings.insecure_no_auth)
    if problem:
        raise ConfigError(problem)
    needed = open_files_needed(settings.max_connections, settings.max_websockets)
    try:
        allow_open_files(needed)
    except OSError as exc:
        raise ConfigError(f"max_connections {settings.max_connections} and max_websockets {settings.max_websockets} "
                          f"need up to {needed} open files: {exc}; raise `ulimit -n` or lower them") from None
    if not is_loopback(settings.host) and not settings.api_key:
        log.warning("SERVING %s WITHOUT AN API KEY (--insecure-no-auth): anyone who can reach port %d reads "
                    "and changes every agent's history", settings.host, settings.port)
    with home_lock.serving(settings):
        _serve(settings)


def _serve(settings: Settings) -> None:
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)
    import_mlx_lm()  # before anything else imports it: the open-files limit set in serve() stays
    # Imported only now: MLX must see OpenBLAS first.
    from app.cache.shared_tier import S3Tier
    from app.catalog.registry import Catalog, configured_model_dir, install_configured_parts
    from app.engine.engine import CacheConfig, Engine
    from app.store.db import is_postgres_url, make_engine, make_session_factory, upgrade

    for configured in (settings.model, settings.draft_model):
        if configured:
            install_configured_parts(settings.models_dir, configured)
    catalog = Catalog.configure(settings.models_dir, settings.model, settings.model_aliases,
                                settings.map_unknown_models, settings.serve_installed_models)
    upgrade(settings.db_url)
    sessions = make_session_factory(make_engine(settings.db_url, settings.db_busy_timeout_s))
    # A shared (PostgreSQL) store: with a shared block tier every server may restore every
    # cache; without one, this server's caches are its own (hashing.scoped_fingerprint).
    tier = S3Tier(settings.block_store) if settings.block_store else None
    scope = settings.effective_server_id if is_postgres_url(settings.db_url) and tier is None else ""
    prefill_step_size, cache_memory_bytes, speculative_tokens = _machine_defaults(settings, catalog)
    cache = CacheConfig(settings.blocks_dir, sessions, cache_memory_bytes, settings.cache_reuse,
                        settings.max_conversations, settings.kv_format_for, scope, tier,
                        settings.effective_server_id if tier is not None else None)
    draft = configured_model_dir(settings.models_dir, settings.draft_model) if settings.draft_model else None
    engine = Engine(catalog, cache, dtype=settings.dtype, max_queue=settings.max_queue,
                    max_queue_wait_s=settings.max_queue_wait_s, prefill_checkpoint_s=settings.prefill_checkpoint_s,
                    max_batch=settings.max_batch, prefill_step_size=prefill_step_size,
                    repetition_penalty=settings.repetition_penalty, split_cores=settings.split_cores,
                    speculative_tokens=speculative_tokens,
                    draft_model=draft, calibrate_at_load=False)  # a first start serves at once
    agents = AgentService(sessions, settings.effective_server_id)
    interrupted = agents.interrupt_unfinished(alone=not is_postgres_url(settings.db_url))
    if interrupted:
        log.warning("%d request(s) left running by this server's last process (a crash, a kill, a full disk) "
                    "marked interrupted", interrupted)
    app = create_app(Deps(settings, engine, agents, sessions))
    try:
        server = make_server(app, **waitress_options(settings))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    engine.start_loading()
    threading.Thread(target=_report_loaded, args=(engine, settings), name="semantic-load-watch", daemon=True).start()
    worker = start_worker(settings) if settings.worker else None
    janitor = start_janitor(settings, sessions, tier)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # graceful: what runs is finished
    ctrl_c = CtrlC(engine)
    ctrl_c.install()  # cancels what runs; a second Ctrl-C exits at once
    log.info("listening on http://%s:%d (model loading; /health says when ready; %.1f s after the process started)",
             settings.host, settings.port, process_age_s())
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if worker is not None:
            stop_worker(worker)
        if janitor is not None:
            janitor.stop()
        engine.stop()
    engine.wait_loaded(0)  # raises EngineUnavailable if loading is what stopped the server
    if ctrl_c.seen:
        raise KeyboardInterrupt  # the command's exit status says so (130)


def start_janitor(settings: Settings, sessions: sessionmaker[Session], tier: S3Tier | None) -> Janitor | None:
    """This server's janitor over its blocks directory (``app/cache/janitor.py``), started;
    None when ``janitor_interval_s`` is 0."""
    from app.cache.janitor import Janitor, JanitorPolicy

    if not settings.janitor_interval_s:
        return None
    policy = JanitorPolicy(settings.janitor_interval_s, settings.quarantine_retention_days * 24 * 3600.0,
                           settings.local_disk_budget_bytes or settings.disk_budget_bytes)
    janitor = Janitor(sessions, settings.blocks_dir, tier, policy, settings.effective_server_id)
    janitor.start()
    return janitor


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module loaded)."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _LOADED_AT


def _machine_defaults(settings: Settings, catalog: Catalog) -> tuple[int, int, int]:
    """The prefill step, the KV memory budget and the longest draft: the settings', or (0;
    not set, for the draft) chosen for this machine's backend and the default model's weights.
    A draft model set drafts on any backend. Logged either way."""
    from app.engine.backend import cache_budget, detect, drafts_pay, prefill_step

    backend = detect()
    step = settings.prefill_step_size or prefill_step(backend)
    if settings.cache_memory_bytes:
        weights, budget = 0, settings.cache_memory_bytes
    else:
        weights = _default_weights(catalog)
        budget = cache_budget(backend, weights)
    drafts_set = "speculative_tokens" in settings.model_fields_set
    drafts = settings.speculative_tokens if drafts_set or settings.draft_model or drafts_pay(backend) else 0
    log.info("memory: %s", huge_pages.describe(os.environ, huge_pages.thp_mode()))
    log.info("backend %s (%s, %.1f GiB): prefill step %d tokens (%s), KV cache memory %.1f GiB (%s), %s (%s)",
             backend.kind, backend.name, backend.memory_bytes / 2**30, step,
             "set" if settings.prefill_step_size else "per backend", budget / 2**30,
             "set" if settings.cache_memory_bytes else f"from the machine, beside {weights / 2**30:.1f} GiB of weights",
             f"drafts of up to {drafts} tokens" if drafts else "no drafts",
             "set" if drafts_set else "for the draft model" if settings.draft_model else "per backend")
    return step, budget, drafts


def _default_weights(catalog: Catalog) -> int:
    """Bytes of the default model's weights, which the derived KV budget leaves room for. An
    embedded model this home has not imported yet is imported now, before the server listens
    (the first load would import it anyway): counted as 0 bytes, it made a home's first start
    derive a larger budget than every later start. 0 if the model cannot be had now (its load
    then says why)."""
    from app.engine.backend import weights_bytes

    try:
        return weights_bytes(catalog.install(catalog.default))
    except (SemanticError, OSError) as exc:
        log.warning("the default model's weights are not counted in the KV budget: %s", exc)
        return 0


STREAM_BUFFER_BYTES = 1 << 30  # above any answer: 1M tokens of context at ~300 bytes of SSE each is 300 MiB


def waitress_options(settings: Settings) -> dict[str, object]:
    """How waitress serves: its limits hold before the app, the key check or a 413 runs."""
    return {
        "host": settings.host, "port": settings.port, "threads": settings.threads,
        "ident": f"semantic/{__version__}",  # the Server header
        # Keeps reading each socket during a request, so a client that hangs up is noticed
        # (waitress.client_disconnected) and its work cancelled.
        "channel_request_lookahead": 1,
        # A body announced beyond this is refused unread (bodies up to it get the app's own 413).
        "max_request_body_size": settings.max_body_bytes + (1 << 20),
        "channel_timeout": settings.idle_timeout_s,
        # How often idle sockets, and those past the request-head deadline, are looked for.
        "cleanup_interval": max(1, min(HEAD_TIMEOUT_S // 2, settings.idle_timeout_s // 2)),
        "connection_limit": settings.max_connections,
        # poll(), not select(): select() cannot watch a descriptor at or above 1024, and raised
        # out of the loop (ending the process) once that many sockets were open.
        "asyncore_use_poll": True,
        # A response's unsent bytes stay buffered (in memory up to 1 MiB, then a temporary file)
        # and the thread that wrote them goes back to work: waitress makes it wait only past this
        # watermark (16 MiB by default, ~100K tokens of SSE, reachable with a long context).
        # A client that stops reading then cannot hold a thread; its socket closes after
        # idle_timeout_s once the answer is written.
        "outbuf_high_watermark": STREAM_BUFFER_BYTES,
    }


def _report_loaded(engine: Engine, settings: Settings) -> None:
    """Log when the model is ready; stop the server if it cannot load."""
    from app.engine.blas import blas_in_use

    try:
        engine.wait_loaded()
    except EngineUnavailable as exc:
        log.error("%s", exc)
        _thread.interrupt_main(signal.SIGTERM)  # stops serving as SIGTERM does (SIGINT says Ctrl-C)
        return
    status = engine.status()
    log.info("model %s on %s ready, BLAS: %s, cache reuse %s (%.1f s after the process started)", status.model,
             status.backend, blas_in_use(), "on" if settings.cache_reuse else "OFF", process_age_s())
