"""The background thread that writes conversation caches to their files (``files.py``) and
their index rows, copies them for forks, and deletes them.

The engine thread hands over immutable snapshots after a response; the
persister writes them in order, so persistence never adds to a response's
latency. A crash loses at most snapshots still queued (the newest turns').
Deletions go through the same queue, so a queued write can never bring back
a cache deleted after it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from app.cache.files import CacheFiles, StorableCheckpoint
from app.cache.hashing import BLOCK_TOKENS
from app.cache.records import ConversationCache
from app.cache.shared_tier import Uploader
from app.clock import utcnow
from app.store import cache_index, ownership
from app.store.db import with_retries, write_locked

if TYPE_CHECKING:
    from app.cache.blocks import KVBlock

log = logging.getLogger(__name__)

# A server's shutdown writes what is queued: up to FLUSH_ON_CLOSE_S for the writes to finish
# (``CacheManager.close``), then up to STOP_ON_CLOSE_S for the writer and the shared tier's
# uploads to stop; a supervisor waits longer than both before it kills a server.
FLUSH_ON_CLOSE_S = 30.0
STOP_ON_CLOSE_S = 30.0

# Snapshots and deletions waiting to be written, at most: past it the engine thread waits
# for the disk (back-pressure) rather than hold ever more snapshots in memory.
MAX_QUEUED = 256
WRITE_ATTEMPTS = 3  # a snapshot's block files are rewritten if the worker deleted them meanwhile
INDEX_ATTEMPTS = 4  # a locked database is waited out (with_retries: 0.1, 0.2, 0.4 s apart)


@dataclass(frozen=True)
class Snapshot:
    """Write ``cache``; ``blocks`` holds the chain's blocks (those not on disk yet get written).
    ``epoch``: in a pool, the agent's ownership epoch the cache was computed under (indexed
    only while it is current). ``shared``: hybrid models, checkpoints at block boundaries to
    keep as shared ones, by the id of the chain's block that ends where each was taken."""

    cache: ConversationCache
    blocks: dict[str, KVBlock]
    epoch: int | None = None
    shared: Mapping[str, StorableCheckpoint] = field(default_factory=dict)


@dataclass(frozen=True)
class Copy:
    """Give a new conversation (of a forked agent) a copy of ``source``'s cache: the same
    blocks, shared by reference, and a record file of its own."""

    source: str
    agent_id: str
    conversation_id: str


@dataclass(frozen=True)
class Forget:
    """Delete a conversation's cache: its record file, its row, blocks nobody else references."""

    conversation_id: str


def describe(item: Snapshot | Copy | Forget) -> str:
    """A queued write as a log line may show it: what and whose, none of its text."""
    if isinstance(item, Snapshot):
        return (f"cache of conversation {item.cache.conversation_id}, {item.cache.record.n_tokens} tokens, "
                f"{len(item.blocks)} blocks")
    if isinstance(item, Copy):
        return f"copy of conversation {item.source}'s cache for {item.conversation_id}"
    return f"deletion of conversation {item.conversation_id}'s cache"


class Persister(threading.Thread):
    def __init__(self, files: CacheFiles, sessions: sessionmaker[Session], owner: str | None = None) -> None:
        super().__init__(name="semantic-persist", daemon=True)
        self._files = files
        self._sessions = sessions
        self._owner = owner
        self._uploader = Uploader(files.tier) if files.tier is not None else None
        if self._uploader is not None:
            self._uploader.start()
        self._queue: queue.Queue[tuple[Snapshot | Copy | Forget, threading.Event] | None] = queue.Queue(MAX_QUEUED)
        self._pending = 0
        self._lock = threading.Condition()

    def submit(self, item: Snapshot | Copy | Forget) -> threading.Event:
        """Queue ``item``; the returned event is set once it is done (written, or failed)."""
        done = threading.Event()
        with self._lock:
            self._pending += 1
        try:
            self._queue.put_nowait((item, done))
        except queue.Full:
            log.warning("%d cache writes are waiting for the disk: waiting for room", MAX_QUEUED)
            self._queue.put((item, done))
        return done

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far is done (written or deleted, and copied to
        the shared tier if there is one), ``timeout_s`` in all: False if it is not."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            written = self._lock.wait_for(lambda: self._pending == 0, timeout_s)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return written and (self._uploader is None or self._uploader.flush(left))

    def stop(self, timeout_s: float = STOP_ON_CLOSE_S) -> bool:
        """Write what is queued, then stop, within ``timeout_s`` in all (the shared tier's
        uploads included): False, with a warning naming what is left unwritten, if the disk
        (or the tier) does not keep up. Never blocks longer: a stalled disk cannot hold
        shutdown (the thread is a daemon; the writes left are future cache misses)."""
        deadline = time.monotonic() + timeout_s
        try:  # a full queue waits for the disk: no longer than the deadline
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self.join(max(0.0, deadline - time.monotonic()))
        if self.is_alive():
            with self._lock:
                left = self._pending
            log.warning("cache persister: %d cache write(s) not done after %.0f s (a stalled disk?): "
                        "stopping without them (those conversations' next turns prefill again)", left, timeout_s)
            return False
        return self._uploader is None or self._uploader.stop(max(0.0, deadline - time.monotonic()))

    def run(self) -> None:
        while (queued := self._queue.get()) is not None:
            item, done = queued
            try:
                if isinstance(item, Snapshot):
                    self._write(item)
                elif isinstance(item, Copy):
                    self._copy(item)
                else:
                    self._forget(item.conversation_id)
            except Exception:  # a failed write is a future cache miss, never a crash
                # NOTE: named, never shown whole: a snapshot holds the prompt's text
                log.exception("persisting a cache failed (%s)", describe(item))
            finally:
                done.set()
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _write(self, snapshot: Snapshot) -> None:
        cache = snapshot.cache
        record_path, record_checksum = self._files.write_record(cache)
        for _ in range(WRITE_ATTEMPTS):
            known = with_retries(lambda: self._block_checksums(cache.chain), INDEX_ATTEMPTS)
            written = [self._files.write_block(block, snapshot.blocks[block], known.get(block))
                       for block in cache.chain]
            shared = self._write_shared(snapshot.shared)
            # Another writer (the worker, a second process) may hold the database: wait it out
            # as a finished turn's history does, rather than lose the cache's rows.
            indexed, previous = with_retries(
                partial(self._index, cache, record_path, record_checksum, written, snapshot.epoch, shared),
                INDEX_ATTEMPTS)
            if indexed is None:  # another server owns the agent now (its cache is the one that counts), or it went
                record_path.unlink(missing_ok=True)
                log.warning("conversation %s: not indexed, agent %s is owned by another server since "
                            "(or the conversation was deleted)", cache.conversation_id, cache.agent_id)
                return
            if not indexed:
                continue
            # Only now: a crash before the commit leaves the previous record in force (and the new
            # file an orphan for the worker's compact), never a row without its file.
            if previous is not None and previous.record_path != str(record_path):
                self._files.local(previous.record_path, fetch=False).unlink(missing_ok=True)
            if self._uploader is not None:
                self._uploader.submit(self._files.upload(
                    [*(path for path, _ in written), *(Path(point.path) for point in shared)], record_path))
            return
        raise RuntimeError(f"the block files of conversation {cache.conversation_id} kept being deleted")

    def _write_shared(self, points: Mapping[str, StorableCheckpoint]) -> list[cache_index.SharedCheckpoint]:
        """Write the shared checkpoints not on disk yet (as the index knows them); returns the
        rows to index."""
        if not points:
            return []
        with self._sessions() as session:
            known = with_retries(lambda: cache_index.block_checkpoints(session, list(points)), INDEX_ATTEMPTS)
        rows = []
        for block, point in points.items():
            path, digest = self._files.write_shared_checkpoint(block, point, known[block].checksum
                                                               if block in known else None)
            rows.append(cache_index.SharedCheckpoint(block, str(path), digest, path.stat().st_size))
        return rows

    def _block_checksums(self, chain: tuple[str, ...]) -> dict[str, str]:
        with self._sessions() as session:
            return cache_index.block_checksums(session, chain)

    def _index(self, cache: ConversationCache, record_path: Path, record_checksum: str,
               written: list[tuple[Path, str]], epoch: int | None,
               shared: Sequence[cache_index.SharedCheckpoint] = (),
               ) -> tuple[bool | None, cache_index.CacheEntry | None]:
        """Index the written files in one transaction: (False, None) if a block file was
        deleted meanwhile, (None, None) if this server no longer owns the agent (pool mode) or
        the conversation is gone (its rows are the history writer's: created before the turn
        ran, deleted with its agent), else (True, the entry it replaced)."""
        with write_locked(self._sessions) as session:
            if self._owner is not None and epoch is not None and \
                    not ownership.still_owns(session, cache.agent_id, self._owner, epoch):
                return None, None
            if not cache_index.has_conversation(session, cache.conversation_id):
                return None, None
            # A block file that existed above may have been deleted since by the worker
            # (its row was dropped); under the lock no deleter runs, and after this
            # commit the rows protect the files.
            if not all(path.exists() for path in [*(p for p, _ in written), *(Path(c.path) for c in shared)]):
                return False, None
            rows = [cache_index.BlockRow(block, parent, BLOCK_TOKENS, str(path), path.stat().st_size, digest)
                    for block, parent, (path, digest) in zip(cache.chain, (None, *cache.chain), written)]
            now = utcnow()
            previous = cache_index.load_cache(session, cache.conversation_id, self._files.fingerprint)
            cache_index.save_cache(session, cache.agent_id, cache.conversation_id, self._files.fingerprint,
                                   cache.record.n_tokens, str(record_path), rows, now, record_checksum=record_checksum)
            cache_index.save_block_checkpoints(session, shared)  # in the same transaction as the rows
            return True, previous

    def _copy(self, item: Copy) -> None:
        """In one write-locked transaction, so the source's record cannot be replaced and
        deleted while it is read, nor its blocks dropped before the copy references them. The
        fork's conversation is the history writer's (``store/agents.py``: ``fork``), made first."""
        fingerprint = self._files.fingerprint
        with write_locked(self._sessions) as session:
            entry = cache_index.load_cache(session, item.source, fingerprint)
            if entry is None or not cache_index.has_conversation(session, item.conversation_id):
                return
            record_path, record_checksum = self._files.copy_record(entry.record_path, item.agent_id,
                                                                   item.conversation_id, entry.record_checksum)
            cache_index.save_cache(session, item.agent_id, item.conversation_id, fingerprint, entry.n_tokens,
                                   str(record_path), entry.blocks, utcnow(), record_checksum=record_checksum)
        if self._uploader is not None:  # blocks gone from this disk are skipped (the tier holds them)
            self._uploader.submit(self._files.upload([self._files.local(b.path, fetch=False) for b in entry.blocks],
                                                     record_path))

    def _forget(self, conversation_id: str) -> None:
        with self._sessions.begin() as session:
            entry = cache_index.load_cache(session, conversation_id, self._files.fingerprint)
            orphans = cache_index.drop_cache(session, conversation_id, self._files.fingerprint)
        paths = [entry.record_path] if entry else []
        for path in [*paths, *orphans]:
            # This server's copy: a row may name another server's root (a pool on one machine).
            self._files.local(path, fetch=False).unlink(missing_ok=True)
