"""Worker jobs' effects on the store, each recorded in ``job_runs``.

Only housekeeping that needs no cache logic lives here for now; expire and
evict arrive with the persistent cache.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from app.store.history import utcnow
from app.store.models import JobRun

TEMP_SUFFIX = ".tmp"
TEMP_GRACE_S = 3600  # a temporary file this old was left by a crash


def remove_stale_temp_files(root: Path, now_s: float) -> list[str]:
    """Delete ``*.tmp`` files under ``root`` older than the grace period."""
    removed = []
    for path in root.rglob(f"*{TEMP_SUFFIX}") if root.exists() else ():
        if now_s - path.stat().st_mtime > TEMP_GRACE_S:
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def run_compact(sessions: sessionmaker[Session], blocks_dir: Path) -> dict[str, Any]:
    """Remove crash leftovers and let SQLite tidy its statistics; record the run."""
    started = utcnow()
    removed = remove_stale_temp_files(blocks_dir, time.time())
    with sessions.begin() as session:
        session.execute(text("PRAGMA optimize"))
    result = {"removed_temp_files": len(removed)}
    record_run(sessions, "compact", started, utcnow(), result)
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
