"""Each server's own disk: the janitor thread ``semantic serve`` runs beside the engine.

The worker's jobs run on one host (the store's) and see its disk only. Every server of a
pool also keeps, under its own ``blocks/``, copies of the shared tier's objects it fetched
and the damaged files it quarantined; the janitor cleans those on its own host, every
``interval_s``:

- quarantined files older than ``quarantine_retention_s`` are deleted (kept until then for
  inspection: ``files.quarantine`` dates them when it moves them);
- cache files that no index row names, nor is a copy of one a row names
  (``upkeep.orphan_files``), unused for the grace period, are deleted, each rechecked under
  the store's write lock (``upkeep.delete_unreferenced``: a file a row came to name stays);
- with a shared tier, while the cache files exceed ``budget_bytes``: the least recently used
  files the tier holds a copy of, unused for the grace period, are deleted: this host's
  disk is then a cache of the tier. Each copy is checked just before (``S3Tier.holds_copy``:
  its ETag against the file's MD5), as a HEAD alone proves a key and not the bytes. A file
  the tier does not hold (not uploaded yet, or lost) or holds other bytes of (damaged) is
  kept whatever the budget: the pool's last good copy may be this one. Whoever needs a deleted file gets it
  again: a restore fetches it (``CacheFiles.local``), the persister writes a block again
  when its file is gone (``CacheFiles.write_block``), the uploader skips a block that went
  (the tier holds it).

Each sweep is recorded in ``job_runs`` as ``janitor`` (the server's id in its result).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cache import files
from app.cache.upkeep import GRACE_S, delete_unreferenced, orphan_files
from app.clock import utcnow
from app.store.jobs import record_run

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.cache.shared_tier import S3Tier

log = logging.getLogger(__name__)

JOB_NAME = "janitor"


@dataclass(frozen=True, slots=True)
class JanitorPolicy:
    """How often the janitor sweeps and what it keeps."""

    interval_s: float
    quarantine_retention_s: float
    budget_bytes: int  # the cache files this host keeps; beyond it, those the tier holds go


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A cache file on this host's disk, and when it was last written or read."""

    path: Path
    nbytes: int
    last_used: float


def expire_quarantine(root: Path, retention_s: float, now_s: float) -> list[Path]:
    """Delete the quarantined files under ``root`` moved there over ``retention_s`` ago."""
    removed = []
    for path in files.quarantined_files(root):
        try:
            if now_s - path.stat().st_mtime > retention_s:
                path.unlink()
                removed.append(path)
        except FileNotFoundError:
            continue
    return removed


def _local_files(root: Path) -> list[LocalFile]:
    """Every cache file under ``root`` (quarantine aside), least recently used first."""
    found = []
    for path in files.cache_files(root):
        try:
            found.append(LocalFile(path, path.stat().st_size, files.last_used(path)))
        except FileNotFoundError:
            continue
    return sorted(found, key=lambda f: f.last_used)


def over_budget(root: Path, tier: S3Tier, budget_bytes: int, now_s: float) -> list[LocalFile]:
    """The cache files under ``root`` to delete, least recently used first, until they fit
    ``budget_bytes``: those unused for the grace period (``GRACE_S``: a file written or read
    this recently may be in use) that the tier holds a copy of (asked one by one, only as
    far as needed; a tier that does not answer holds nothing)."""
    local = _local_files(root)
    used = sum(f.nbytes for f in local)
    doomed = []
    for candidate in local:
        if used <= budget_bytes:
            break
        if now_s - candidate.last_used <= GRACE_S:
            continue
        key = candidate.path.relative_to(root).as_posix()
        try:
            held = tier.holds_copy(key, candidate.path)
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001  (the tier does not answer: nothing is known held)
            log.warning("janitor: the shared tier did not answer (%s); no copy deleted", exc)
            break
        if held:
            doomed.append(candidate)
            used -= candidate.nbytes
    return doomed


def _unlink(doomed: list[LocalFile]) -> tuple[int, int]:
    """Delete files; returns (files deleted, bytes freed)."""
    n, freed = 0, 0
    for local in doomed:
        try:
            local.path.unlink()
        except FileNotFoundError:
            continue
        n, freed = n + 1, freed + local.nbytes
    return n, freed


def sweep(sessions: sessionmaker[Session], root: Path, tier: S3Tier | None, policy: JanitorPolicy,
          now_s: float | None = None) -> dict[str, Any]:
    """One pass of the janitor over ``root`` (see the module's docstring); returns what it did."""
    now_s = time.time() if now_s is None else now_s
    quarantined = expire_quarantine(root, policy.quarantine_retention_s, now_s)
    with sessions() as session:  # reads only: the deletions recheck under the write lock
        orphans = orphan_files(session, root, now_s)
    n_orphans, orphan_bytes = delete_unreferenced(sessions, orphans)
    n_copies, copy_bytes = 0, 0
    if tier is not None:  # no lock needed: what the tier holds, a reader fetches again
        n_copies, copy_bytes = _unlink(over_budget(root, tier, policy.budget_bytes, now_s))
    return {"quarantined_deleted": len(quarantined), "orphans_deleted": n_orphans, "copies_deleted": n_copies,
            "bytes_freed": orphan_bytes + copy_bytes}


class Janitor(threading.Thread):
    """Sweeps this server's ``root`` every ``policy.interval_s`` (the first one interval
    after it starts) until ``stop``. A sweep that fails (the database is down) is logged and
    tried again at the next interval."""

    def __init__(self, sessions: sessionmaker[Session], root: Path, tier: S3Tier | None, policy: JanitorPolicy,
                 server_id: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="semantic-janitor", daemon=True)
        self._sessions = sessions
        self._root = root
        self._tier = tier
        self._policy = policy
        self._server_id = server_id
        self._clock = clock
        self._stopping = threading.Event()

    def sweep(self) -> dict[str, Any]:
        """One sweep now, recorded in ``job_runs``; returns its result."""
        started = utcnow()
        result = {"server": self._server_id,
                  **sweep(self._sessions, self._root, self._tier, self._policy, self._clock())}
        record_run(self._sessions, JOB_NAME, started, utcnow(), result)
        log.info("janitor: %s", result)
        return result

    def run(self) -> None:
        while not self._stopping.wait(self._policy.interval_s):
            try:
                self.sweep()
            except Exception:
                log.exception("janitor: sweep of %s failed", self._root)

    def stop(self, timeout_s: float = 10) -> None:
        """Stop after the sweep in progress, if any."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)
