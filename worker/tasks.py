"""Periodic jobs. Each is a few lines around an ``app.cache.upkeep`` or ``app.store.jobs`` function.

Every run leaves a ``job_runs`` row: ``ok`` (written by the job with its
result), ``error`` (the exception, written here, then re-raised for Huey to
log) or ``skipped`` (another worker holds the job's lock: two workers never run
one job at once). Locks live in Huey's storage (``huey.db`` on SQLite, the store's
database in a pool: ``huey_app.py``); the consumer flushes them when it starts, so a
worker killed mid-job does not wedge its job.

The worker never imports ``app.engine`` or MLX.
"""

from __future__ import annotations

import functools
import glob
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from huey import crontab
from huey.exceptions import TaskLockedException
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.cache import upkeep
from app.clock import utcnow
from app.store import jobs
from app.store.db import make_engine, make_session_factory
from worker.huey_app import huey, settings

log = logging.getLogger(__name__)


@contextmanager
def _store() -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    engine = make_engine(settings.db_url)
    try:
        yield engine, make_session_factory(engine)
    finally:
        engine.dispose()


def _recorded(job: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """Run ``job`` under its lock; record a failed or skipped run in ``job_runs``."""
    lock = huey.lock_task(job.__name__)

    def record(started: Any, result: dict[str, Any], status: str) -> None:
        try:
            with _store() as (_, sessions):
                jobs.record_run(sessions, job.__name__, started, utcnow(), result, status)
        except Exception:  # the store itself may be what fails; the job's own error is raised below
            log.exception("job %s: could not record its %s run", job.__name__, status)

    @functools.wraps(job)
    def run() -> dict[str, Any]:
        started = utcnow()
        try:
            with lock:
                return job()
        except TaskLockedException:
            log.warning("job %s: another worker is running it; skipped", job.__name__)
            result = {"skipped": "another worker holds this job's lock"}
            record(started, result, "skipped")
            return result
        except Exception as exc:
            record(started, {"error": f"{type(exc).__name__}: {exc}"[:1000]}, "error")
            raise

    return run


@huey.periodic_task(crontab(minute="*/10"))
@_recorded
def expire() -> dict[str, Any]:
    """Every 10 minutes: caches unused for longer than their TTL go cold (files deleted, history kept)."""
    with _store() as (_, sessions):
        return upkeep.run_expire(sessions, settings.cache_ttl_seconds)


@huey.periodic_task(crontab(minute="5-59/10"))
@_recorded
def evict() -> dict[str, Any]:
    """Every 10 minutes: least recently used caches go cold until the files fit the disk budget."""
    with _store() as (_, sessions):
        return upkeep.run_evict(sessions, settings.disk_budget_bytes)


@huey.periodic_task(crontab(minute="17"))
@_recorded
def compact() -> dict[str, Any]:
    """Hourly: delete unreferenced blocks, orphan and temporary files, verify a sample of checksums, VACUUM."""
    with _store() as (engine, sessions):
        more = [Path(found) for pattern in settings.compact_dirs.split(",") if pattern.strip()
                for found in sorted(glob.glob(pattern.strip()))]
        return upkeep.run_compact(engine, sessions, settings.blocks_dir, more_dirs=more)


@huey.periodic_task(crontab(hour="3", minute="41"))
@_recorded
def prune() -> dict[str, Any]:
    """Daily: job runs and request rows older than log_retention_days (history stays)."""
    with _store() as (_, sessions):
        return jobs.run_prune(sessions, settings.log_retention_days)


@huey.periodic_task(crontab(minute="29"))
@_recorded
def tier_gc() -> dict[str, Any]:
    """Hourly, in a pool with a shared tier: delete the bucket's objects no row names any more."""
    from app.cache.shared_tier import S3Tier
    from app.cache.tier_gc import collect

    started = utcnow()
    with _store() as (_, sessions):
        result = (collect(sessions, S3Tier(settings.block_store)) if settings.block_store
                  else {"skipped": "no shared tier (block_store is not set)"})
        jobs.record_run(sessions, "tier_gc", started, utcnow(), result)
        return result


JOBS = {"expire": expire, "evict": evict, "compact": compact, "prune": prune, "tier_gc": tier_gc}
