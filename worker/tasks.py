"""Periodic jobs. Each is a few lines around an ``app.store.jobs`` function.

The worker never imports ``app.engine`` or MLX.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from huey import crontab
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.store import jobs
from app.store.db import make_engine, make_session_factory
from worker.huey_app import huey, settings


@contextmanager
def _store() -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    engine = make_engine(settings.db_url)
    try:
        yield engine, make_session_factory(engine)
    finally:
        engine.dispose()


@huey.periodic_task(crontab(minute="*/10"))
def expire() -> dict[str, Any]:
    """Every 10 minutes: caches unused for longer than their TTL go cold (files deleted, history kept)."""
    with _store() as (_, sessions):
        return jobs.run_expire(sessions, settings.cache_ttl_seconds)


@huey.periodic_task(crontab(minute="5-59/10"))
def evict() -> dict[str, Any]:
    """Every 10 minutes: least recently used caches go cold until the files fit the disk budget."""
    with _store() as (_, sessions):
        return jobs.run_evict(sessions, settings.disk_budget_bytes)


@huey.periodic_task(crontab(minute="17"))
def compact() -> dict[str, Any]:
    """Hourly: delete unreferenced blocks, orphan and temporary files, verify a sample of checksums, VACUUM."""
    with _store() as (engine, sessions):
        return jobs.run_compact(engine, sessions, settings.blocks_dir)


JOBS = {"expire": expire, "evict": evict, "compact": compact}
