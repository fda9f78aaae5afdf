"""The worker's cache jobs: expire, evict and compact, on the cache index and the cache files.
No MLX. Each run is recorded in ``job_runs`` (``app.store.jobs``).

Rows change first, in one short transaction (``app.store.cache_index``); files are deleted
after it commits, if no row took them back meanwhile (``delete_unreferenced``). A crash in
between leaves files no row points to, which ``compact`` removes later; a row never points
to a file that was deleted on purpose. Files younger than ``GRACE_S`` are never taken as
orphans: the server writes a cache's files before the rows that reference them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.cache import files
from app.clock import utcnow
from app.store import cache_index
from app.store.db import write_locked
from app.store.jobs import maintain_database, record_run

GRACE_S = 600  # a file or unreferenced block this old is no longer being written or reused
VERIFY_SAMPLE = 32  # block and record files whose checksums compact verifies per run


def delete_unreferenced(sessions: sessionmaker[Session], paths: Iterable[str | Path]) -> tuple[int, int]:
    """Delete the files among ``paths`` no row points to; returns (files deleted, bytes freed).

    Under the write lock: the server, before it commits rows pointing to a cache's
    files, checks under that lock that they exist (rewriting any that went). So a
    block file the server took back after a job dropped its row is never deleted, and
    a row never points to a file this deleted.
    """
    named = [str(p) for p in paths]
    if not named:
        return 0, 0
    n, freed = 0, 0
    with write_locked(sessions) as session:
        referenced = cache_index.referenced_paths(session, named)
        for path in map(Path, (p for p in named if p not in referenced)):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            n, freed = n + 1, freed + size
    return n, freed


def run_expire(sessions: sessionmaker[Session], default_ttl_s: int, now: datetime | None = None) -> dict[str, Any]:
    """Make cold every cache whose agent was last used longer ago than its TTL
    (the agent's ``ttl_seconds``, else ``default_ttl_s``). History is kept."""
    started = now or utcnow()
    with write_locked(sessions) as session:
        expired, doomed = [], []
        for cache in cache_index.expired_caches(session, default_ttl_s, started):
            expired.append(cache.conversation_id)
            doomed += cache_index.retire_cache(session, cache)
    deleted, freed = delete_unreferenced(sessions, doomed)
    result = {"expired": len(expired), "conversations": expired[:100], "files_deleted": deleted, "bytes_freed": freed}
    record_run(sessions, "expire", started, utcnow(), result)
    return result


def run_evict(sessions: sessionmaker[Session], budget_bytes: int) -> dict[str, Any]:
    """Make the least recently used caches cold until the files fit ``budget_bytes``."""
    started = utcnow()
    with write_locked(sessions) as session:
        used = before = cache_index.disk_bytes(session)
        evicted, doomed = [], []
        for cache in cache_index.warm_caches_oldest_first(session):
            if used <= budget_bytes:
                break
            retired = cache_index.retire_cache(session, cache)
            used -= cache_index.files_size(retired)
            evicted.append(cache.conversation_id)
            doomed += retired
    deleted, freed = delete_unreferenced(sessions, doomed)
    result = {"bytes_before": before, "budget_bytes": budget_bytes, "evicted": len(evicted),
              "conversations": evicted[:100], "files_deleted": deleted, "bytes_freed": freed}
    record_run(sessions, "evict", started, utcnow(), result)
    return result


def _older_than_grace(path: Path, now_s: float) -> bool:
    """Whether ``path`` was last written or read (``files.last_used``) over the grace period
    ago (False if it is gone: files vanish during a scan, and that must not abort the job)."""
    try:
        return now_s - files.last_used(path) > GRACE_S
    except FileNotFoundError:
        return False


def remove_stale_temp_files(root: Path, now_s: float) -> list[str]:
    """Delete temporary files under ``root`` older than the grace period (left by crashes)."""
    removed = []
    for path in files.temporary_files(root):
        if _older_than_grace(path, now_s):
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def orphan_files(session: Session, root: Path, now_s: float) -> list[Path]:
    """Cache files under ``root`` older than the grace period that are neither a file a row
    names nor a copy of one: in a pool, rows name the writing server's paths, and another
    server keeps copies under the same key (``files.tier_key``) below its own root."""
    known = cache_index.known_paths(session)
    keys = {key for tag in _fingerprint_dirs(root) for path in known if (key := files.tier_key(path, tag)) is not None}
    return [path for path in files.cache_files(root)
            if str(path) not in known and path.relative_to(root).as_posix() not in keys
            and _older_than_grace(path, now_s)]


def _fingerprint_dirs(root: Path) -> list[str]:
    return [child.name for child in root.iterdir() if child.is_dir()] if root.is_dir() else []


def _damaged_sample(session: Session, root: Path, sample: int) -> tuple[int, list[tuple[str, str]],
                                                                         list[tuple[int, str]]]:
    """Check the checksums of a random sample of block and record files; quarantine the
    damaged ones. Reads only: the caller retires what needs them in a short write. A file
    that is gone is not damage: a turn may have replaced it since the rows were read.

    Returns (files checked, (hash, path) of damaged blocks, (cache id, path) of damaged records).
    """
    blocks = cache_index.block_files(session)
    records = cache_index.record_files(session)
    picked_blocks = random.sample(blocks, min(sample, len(blocks)))
    picked_records = random.sample(records, min(sample, len(records)))
    damaged_blocks = [(h, p) for h, p, c in picked_blocks if files.quarantine_if_damaged(Path(p), root, c or None)]
    damaged_records = [(i, p) for i, p in picked_records if files.quarantine_if_damaged(Path(p), root)]
    return len(picked_blocks) + len(picked_records), damaged_blocks, damaged_records


def _retire_damaged(session: Session, damaged_blocks: list[tuple[str, str]],
                    damaged_records: list[tuple[int, str]]) -> tuple[int, list[str]]:
    """Make cold every cache that still needs a damaged file (its row still points at the
    file that failed: a turn that wrote new files since keeps them). Returns (caches made
    cold, files to delete)."""
    users = cache_index.caches_needing(session, damaged_blocks, damaged_records)
    doomed: list[str] = []
    for cache in users:
        doomed += cache_index.retire_cache(session, cache)
    return len(users), doomed


def run_compact(engine: Engine, sessions: sessionmaker[Session], blocks_dir: Path,
                sample: int = VERIFY_SAMPLE, more_dirs: Sequence[Path] = ()) -> dict[str, Any]:
    """Delete what nothing uses (unreferenced blocks, orphan files, crash leftovers) in
    ``blocks_dir`` and ``more_dirs`` (a pool's servers' directories on this machine), verify
    a sample of checksums, and VACUUM the database when much of it is free.

    Scanning the directory and reading files happen outside any write transaction;
    the write that follows is short, so the server's turns never wait on compact.
    """
    started, now_s = utcnow(), time.time()
    before = started - timedelta(seconds=GRACE_S)
    roots = [blocks_dir, *more_dirs]
    temp = [removed for root in roots for removed in remove_stale_temp_files(root, now_s)]
    with sessions() as session:  # reads only: no write lock is taken
        unreferenced = cache_index.unreferenced_blocks(session, before)
        orphans = [orphan for root in roots for orphan in orphan_files(session, root, now_s)]
        checked, damaged_blocks, damaged_records = _damaged_sample(session, blocks_dir, sample)
    with write_locked(sessions) as session:
        dropped = cache_index.drop_blocks(session, unreferenced, before)
        damaged, damaged_files = _retire_damaged(session, damaged_blocks, damaged_records)
    deleted, freed = delete_unreferenced(sessions, [*dropped, *orphans, *damaged_files])
    vacuumed = maintain_database(engine)
    result = {"removed_temp_files": len(temp), "unreferenced_blocks": len(dropped),
              "orphan_files": len(orphans), "verified_files": checked, "damaged_caches": damaged,
              "files_deleted": deleted, "bytes_freed": freed, "vacuumed": vacuumed}
    record_run(sessions, "compact", started, utcnow(), result)
    return result
