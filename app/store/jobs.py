"""The worker's job runs (``job_runs``), its store jobs (prune, database maintenance), and
what the status pages read of them. The cache jobs (expire, evict, compact) are
``app.cache.upkeep``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, func, select, text, union
from sqlalchemy.orm import Session, sessionmaker

from app.clock import utcnow
from app.errors import StoreBusy
from app.store.db import is_postgres, with_retries, write_locked
from app.store.models import JobRun, Message, Request, StoredResponse

log = logging.getLogger(__name__)

VACUUM_MIN_FREE_BYTES = 1 << 20


def _maintain(engine: Engine, statement: str) -> bool:
    """Run a maintenance statement; while the server writes it may find the database
    busy (a write that began as a read fails at once in WAL mode): it is retried, then
    left for the next run. Returns whether it ran."""
    def run() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(statement))

    try:
        with_retries(run, attempts=3, backoff_s=0.5)
    except StoreBusy:
        log.warning("compact: %s skipped, the database stayed busy", statement)
        return False
    return True


def _worth_vacuuming(engine: Engine) -> bool:
    """VACUUM rewrites the whole file under an exclusive lock: only when a quarter of
    the pages (and at least 1 MiB) are free."""
    with engine.connect() as connection:
        free = int(connection.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
        pages = int(connection.exec_driver_sql("PRAGMA page_count").scalar() or 0)
        page_size = int(connection.exec_driver_sql("PRAGMA page_size").scalar() or 4096)
    return free * page_size >= VACUUM_MIN_FREE_BYTES and free * 4 >= pages


def maintain_database(engine: Engine) -> bool:
    """SQLite's upkeep after compact: VACUUM when worth it (returns whether it ran), then
    ``PRAGMA optimize``. PostgreSQL's autovacuum does this for itself."""
    if is_postgres(engine):
        return False
    vacuumed = _worth_vacuuming(engine) and _maintain(engine, "VACUUM")
    _maintain(engine, "PRAGMA optimize")
    return vacuumed


def run_prune(sessions: sessionmaker[Session], retention_days: int) -> dict[str, Any]:
    """Delete job runs and request rows older than ``retention_days``; a request that a
    stored message or response points to stays (it is part of the history)."""
    started = utcnow()
    cutoff = started - timedelta(days=retention_days)
    with write_locked(sessions) as session:
        runs = session.execute(delete(JobRun).where(JobRun.started_at < cutoff)).rowcount  # type: ignore[attr-defined]
        kept = union(select(Message.request_id).where(Message.request_id.is_not(None)),
                     select(StoredResponse.request_id).where(StoredResponse.request_id.is_not(None)))
        requests = session.execute(delete(Request).where(Request.created_at < cutoff,
                                                         Request.id.not_in(kept))).rowcount  # type: ignore[attr-defined]
    result = {"job_runs_deleted": runs, "requests_deleted": requests, "retention_days": retention_days}
    record_run(sessions, "prune", started, utcnow(), result)
    return result


def record_run(sessions: sessionmaker[Session], name: str, started: datetime,
               finished: datetime, result: dict[str, Any], status: str = "ok") -> None:
    with sessions.begin() as session:
        session.add(JobRun(name=name, started_at=started, finished_at=finished,
                           status=status, result=result))


def run_counts(sessions: sessionmaker[Session]) -> list[tuple[str, str, int]]:
    """(job name, status, number of runs) over ``job_runs``."""
    with sessions() as session:
        rows = session.execute(select(JobRun.name, JobRun.status, func.count()).group_by(JobRun.name, JobRun.status))
        return [(name, status, int(n)) for name, status, n in rows]


@dataclass(frozen=True, slots=True)
class JobRunView:
    name: str
    status: str
    started_at: datetime
    finished_at: datetime | None
    result: dict[str, Any]


def last_runs(session: Session) -> list[JobRunView]:
    """The most recent run of each job, by name."""
    newest = select(func.max(JobRun.id)).group_by(JobRun.name)
    rows = session.scalars(select(JobRun).where(JobRun.id.in_(newest)).order_by(JobRun.name))
    return [JobRunView(r.name, r.status, r.started_at, r.finished_at, dict(r.result or {})) for r in rows]
