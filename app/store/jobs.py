"""The worker's jobs: what each does to the store and the cache files, recorded in ``job_runs``.

Rows change first, in one short transaction; files are deleted after it
commits, if no row took them back meanwhile (``delete_unreferenced``). A crash in
between leaves files no row points to, which ``compact`` removes later; a row never
points to a file that was deleted on purpose.
Files younger than ``GRACE_S`` are never taken as orphans: the server writes
a cache's files before the rows that reference them.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import Engine, delete, func, select, text, union
from sqlalchemy.orm import Session, sessionmaker

from app.store import blockfiles, cache_index
from app.errors import StoreBusy
from app.store.db import is_postgres, with_retries, write_locked
from app.store.history import utcnow
from app.store.models import Agent, Block, Cache, CacheBlock, JobRun, Message, Request, StoredResponse

log = logging.getLogger(__name__)

GRACE_S = 600  # a file or unreferenced block this old is no longer being written or reused
VERIFY_SAMPLE = 32  # block and record files whose checksums compact verifies per run
VACUUM_MIN_FREE_BYTES = 1 << 20


def delete_unreferenced(sessions: sessionmaker[Session], paths: Iterable[str | Path]) -> tuple[int, int]:
    """Delete the files among ``paths`` no row points to; returns (files deleted, bytes freed).

    Under the write lock: the server, before it commits rows pointing to a cache's
    files, checks under that lock that they exist (rewriting any that went). So a
    block file the server took back after a job dropped its row is never deleted, and
    a row never points to a file this deleted.
    """
    paths = [str(p) for p in paths]
    if not paths:
        return 0, 0
    n, freed = 0, 0
    with write_locked(sessions) as session:
        referenced = cache_index.referenced_paths(session, paths)
        for path in map(Path, (p for p in paths if p not in referenced)):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            n, freed = n + 1, freed + size
    return n, freed


def _file_size(path: str | None) -> int:
    try:
        return Path(path).stat().st_size if path else 0
    except FileNotFoundError:
        return 0


def run_expire(sessions: sessionmaker[Session], default_ttl_s: int, now: datetime | None = None) -> dict[str, Any]:
    """Make cold every cache whose agent was last used longer ago than its TTL
    (the agent's ``ttl_seconds``, else ``default_ttl_s``). History is kept."""
    started = now or utcnow()
    with write_locked(sessions) as session:
        rows = session.execute(select(Cache, Agent.ttl_seconds, Agent.last_access_at)
                               .join(Agent, Agent.id == Cache.agent_id).where(Cache.tier != "cold")).all()
        expired, files = [], []
        for cache, ttl, agent_access in rows:
            last = max(cache.last_access_at, agent_access)
            if last + timedelta(seconds=default_ttl_s if ttl is None else ttl) <= started:
                expired.append(cache.agent_id)
                files += cache_index.retire_cache(session, cache)
    deleted, freed = delete_unreferenced(sessions, files)
    result = {"expired": len(expired), "agents": expired[:100], "files_deleted": deleted, "bytes_freed": freed}
    record_run(sessions, "expire", started, utcnow(), result)
    return result


def disk_bytes(session: Session) -> int:
    """Bytes of cache files the index points to (blocks and records)."""
    blocks = session.scalar(select(func.coalesce(func.sum(Block.nbytes), 0)).where(Block.path.is_not(None))) or 0
    records = session.scalars(select(Cache.record_path).where(Cache.record_path.is_not(None)))
    return int(blocks) + sum(_file_size(path) for path in records)


def run_evict(sessions: sessionmaker[Session], budget_bytes: int) -> dict[str, Any]:
    """Make the least recently used caches cold until the files fit ``budget_bytes``."""
    started = utcnow()
    with write_locked(sessions) as session:
        used = before = disk_bytes(session)
        evicted, files = [], []
        caches = session.scalars(select(Cache).where(Cache.tier != "cold").order_by(Cache.last_access_at))
        for cache in caches:
            if used <= budget_bytes:
                break
            retired = cache_index.retire_cache(session, cache)
            used -= sum(_file_size(path) for path in retired)
            evicted.append(cache.agent_id)
            files += retired
    deleted, freed = delete_unreferenced(sessions, files)
    result = {"bytes_before": before, "budget_bytes": budget_bytes, "evicted": len(evicted),
              "agents": evicted[:100], "files_deleted": deleted, "bytes_freed": freed}
    record_run(sessions, "evict", started, utcnow(), result)
    return result


def _older_than_grace(path: Path, now_s: float) -> bool:
    """Whether ``path`` was last written over the grace period ago (False if it is gone:
    files vanish during a scan, and that must not abort the job)."""
    try:
        return now_s - path.stat().st_mtime > GRACE_S
    except FileNotFoundError:
        return False


def remove_stale_temp_files(root: Path, now_s: float) -> list[str]:
    """Delete ``*.tmp`` files under ``root`` older than the grace period (left by crashes)."""
    removed = []
    for path in root.rglob(f"*{blockfiles.TEMP_SUFFIX}") if root.exists() else ():
        if _older_than_grace(path, now_s):
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def _unreferenced_blocks(session: Session, before: datetime) -> list[str]:
    """Hashes of blocks no cache references (an agent's chain moved on), unused since ``before``."""
    return list(session.scalars(select(Block.hash).where(Block.ref_count == 0, Block.last_access_at < before)))


def _drop_blocks(session: Session, hashes: list[str], before: datetime) -> list[str]:
    """Delete those of ``hashes`` still unreferenced and unused (the server may have
    taken one back since they were read); returns their files."""
    paths = []
    for start in range(0, len(hashes), 500):  # SQLite bounds the parameters of one statement
        stale = list(session.scalars(select(Block).where(Block.hash.in_(hashes[start:start + 500]),
                                                         Block.ref_count == 0, Block.last_access_at < before)))
        for block in stale:
            session.delete(block)
        paths += [b.path for b in stale if b.path]
    return paths


def _orphan_files(session: Session, root: Path, now_s: float) -> list[Path]:
    """Cache files under ``root`` no row points to, older than the grace period."""
    known = set(session.scalars(select(Block.path).where(Block.path.is_not(None))))
    known |= set(session.scalars(select(Cache.record_path).where(Cache.record_path.is_not(None))))
    quarantine = root / "quarantine"
    return [path for path in (root.rglob("*.safetensors") if root.exists() else ())
            if str(path) not in known and quarantine not in path.parents and _older_than_grace(path, now_s)]


def _damaged_sample(session: Session, root: Path, sample: int) -> tuple[int, list[tuple[str, str]],
                                                                         list[tuple[int, str]]]:
    """Check the checksums of a random sample of block and record files; quarantine the
    damaged ones. Reads only: the caller retires what needs them in a short write. A file
    that is gone is not damage: a turn may have replaced it since the rows were read.

    Returns (files checked, (hash, path) of damaged blocks, (cache id, path) of damaged records).
    """
    blocks = list(session.execute(select(Block.hash, Block.path, Block.checksum).where(Block.path.is_not(None))))
    records = list(session.execute(select(Cache.id, Cache.record_path).where(Cache.record_path.is_not(None))))
    picked_blocks = random.sample(blocks, min(sample, len(blocks)))
    picked_records = random.sample(records, min(sample, len(records)))
    damaged_blocks: list[tuple[str, str]] = []
    damaged_records: list[tuple[int, str]] = []
    for path, expected, damaged, key in ([(p, c or None, damaged_blocks, h) for h, p, c in picked_blocks]
                                         + [(p, None, damaged_records, i) for i, p in picked_records]):
        try:
            blockfiles.read(Path(path), expected)
        except (blockfiles.FileMissing, blockfiles.FileUnavailable):  # checked again another time
            continue
        except blockfiles.DamagedFile:
            blockfiles.quarantine(Path(path), root)
            damaged.append((key, path))
    return len(picked_blocks) + len(picked_records), damaged_blocks, damaged_records


def _retire_damaged(session: Session, damaged_blocks: list[tuple[str, str]],
                    damaged_records: list[tuple[int, str]]) -> tuple[int, list[str]]:
    """Make cold every cache that still needs a damaged file (its row still points at the
    file that failed: a turn that wrote new files since keeps them). Returns (caches made
    cold, files to delete)."""
    hashes = [h for h, path in damaged_blocks if session.scalar(select(Block.path).where(Block.hash == h)) == path]
    users = set(session.scalars(select(Cache).join(CacheBlock, CacheBlock.cache_id == Cache.id)
                                .where(CacheBlock.block_hash.in_(hashes)))) if hashes else set()
    for cache_id, path in damaged_records:
        users |= set(session.scalars(select(Cache).where(Cache.id == cache_id, Cache.record_path == path)))
    files: list[str] = []
    for cache in users:
        files += cache_index.retire_cache(session, cache)
    return len(users), files


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


def run_compact(engine: Engine, sessions: sessionmaker[Session], blocks_dir: Path,
                sample: int = VERIFY_SAMPLE) -> dict[str, Any]:
    """Delete what nothing uses (unreferenced blocks, orphan files, crash leftovers),
    verify a sample of checksums, and VACUUM the database when much of it is free.

    Scanning the directory and reading files happen outside any write transaction;
    the write that follows is short, so the server's turns never wait on compact.
    """
    started, now_s = utcnow(), time.time()
    before = started - timedelta(seconds=GRACE_S)
    temp = remove_stale_temp_files(blocks_dir, now_s)
    with sessions() as session:  # reads only: no write lock is taken
        unreferenced = _unreferenced_blocks(session, before)
        orphans = _orphan_files(session, blocks_dir, now_s)
        checked, damaged_blocks, damaged_records = _damaged_sample(session, blocks_dir, sample)
    with write_locked(sessions) as session:
        dropped = _drop_blocks(session, unreferenced, before)
        damaged, damaged_files = _retire_damaged(session, damaged_blocks, damaged_records)
    deleted, freed = delete_unreferenced(sessions, [*dropped, *orphans, *damaged_files])
    vacuumed = False
    if not is_postgres(engine):  # PostgreSQL's autovacuum does this for itself
        vacuumed = _worth_vacuuming(engine) and _maintain(engine, "VACUUM")
        _maintain(engine, "PRAGMA optimize")
    result = {"removed_temp_files": len(temp), "unreferenced_blocks": len(dropped),
              "orphan_files": len(orphans), "verified_files": checked, "damaged_caches": damaged,
              "files_deleted": deleted, "bytes_freed": freed, "vacuumed": vacuumed}
    record_run(sessions, "compact", started, utcnow(), result)
    return result


def run_prune(sessions: sessionmaker[Session], retention_days: int) -> dict[str, Any]:
    """Delete job runs and request rows older than ``retention_days``; a request that a
    stored message or response points to stays (it is part of the history)."""
    started = utcnow()
    cutoff = started - timedelta(days=retention_days)
    with write_locked(sessions) as session:
        runs = session.execute(delete(JobRun).where(JobRun.started_at < cutoff)).rowcount
        kept = union(select(Message.request_id).where(Message.request_id.is_not(None)),
                     select(StoredResponse.request_id).where(StoredResponse.request_id.is_not(None)))
        requests = session.execute(delete(Request).where(Request.created_at < cutoff,
                                                         Request.id.not_in(kept))).rowcount
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
