"""Conversation caches on disk, both ways: the file format, reading it back, and the
background thread that writes it.

Where the files go is ``app.cache.layout``. A block file holds the six arrays of every
layer, metadata fingerprint / hash / n_tokens; a record file (one per conversation, a
new file each time, the previous one deleted once the index points to the new) holds
token ids and char ends as arrays, the private tail block's arrays, metadata text /
chain / tail_tokens. Every file carries a checksum (``app.store.blockfiles``).

The engine thread hands over immutable snapshots after a response; the
persister writes them in order, so persistence never adds to a response's
latency. A crash loses at most snapshots still queued (the newest turns').
Deletions go through the same queue, so a queued write can never bring back
a cache deleted after it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from app.cache.blocks import BLOCK_TOKENS, KVBlock
from app.cache.layout import FileLayout
from app.cache.records import CacheRecord
from app.cache.shared_tier import S3Tier, Upload, Uploader
from app.store import blockfiles, cache_index, ownership
from app.store.db import with_retries, write_locked
from app.store.history import ensure_conversation, utcnow

log = logging.getLogger(__name__)

# What reading a cache file can raise besides DamagedFile: a file that verifies but
# does not fit (another model's shapes, a record that disagrees with its index).
UNUSABLE = (blockfiles.DamagedFile, KeyError, ValueError)
# Snapshots and deletions waiting to be written, at most: past it the engine thread waits
# for the disk (back-pressure) rather than hold ever more snapshots in memory.
MAX_QUEUED = 256
WRITE_ATTEMPTS = 3  # a snapshot's block files are rewritten if the worker deleted them meanwhile
INDEX_ATTEMPTS = 4  # a locked database is waited out (with_retries: 0.1, 0.2, 0.4 s apart)


@dataclass(frozen=True)
class ConversationCache:
    """A conversation's cache as it stands after a turn: the record, its full blocks
    (by id, in order) and its private partial block."""

    agent_id: str
    conversation_id: str
    record: CacheRecord
    chain: tuple[str, ...]
    tail: KVBlock | None

    @property
    def private_bytes(self) -> int:
        return self.tail.nbytes if self.tail else 0

    @property
    def n_grouped(self) -> int:
        """Tokens whose keys are quantized (per-channel keys: all but the newest, in the tail)."""
        return len(self.chain) * BLOCK_TOKENS + (self.tail.n_grouped if self.tail else 0)


@dataclass(frozen=True)
class Snapshot:
    """Write ``cache``; ``blocks`` holds the chain's blocks (those not on disk yet get written).
    ``epoch``: in a pool, the agent's ownership epoch the cache was computed under (indexed
    only while it is current)."""

    cache: ConversationCache
    blocks: dict[str, KVBlock]
    epoch: int | None = None


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


class CacheFiles(FileLayout):
    """A model's cache files: their layout, and their format both ways."""

    def __init__(self, root: Path, fingerprint: str, n_layers: int, tier: S3Tier | None = None) -> None:
        super().__init__(root, fingerprint, tier)
        self._n_layers = n_layers

    def write_block(self, block: str, data: KVBlock) -> tuple[Path, str]:
        """Write a full block unless its file exists; returns (path, checksum or "" if it existed)."""
        path = self.block_path(block)
        if path.exists():
            return path, ""
        digest, _ = blockfiles.write(path, _numpy(data), {
            "fingerprint": self.fingerprint, "hash": block, "n_tokens": str(data.n_tokens)})
        return path, digest

    def write_record(self, cache: ConversationCache) -> Path:
        arrays = {"tokens": np.array(cache.record.tokens, dtype=np.int64),
                  "ends": np.array(cache.record.ends, dtype=np.int64)}
        if cache.tail is not None:
            arrays.update(_numpy(cache.tail, "tail."))
        path = self.record_path(cache.conversation_id)
        blockfiles.write(path, arrays, {
            "agent_id": cache.agent_id, "conversation_id": cache.conversation_id, "text": cache.record.text,
            "chain": json.dumps(list(cache.chain)), "tail_tokens": str(cache.tail.n_tokens if cache.tail else 0)})
        return path

    def read_block(self, block: str, path: str | Path, checksum: str | None) -> KVBlock:
        """A stored full block, verified to be this model's and this id's.

        Raises:
            One of UNUSABLE.
        """
        path = self.local(path)
        arrays, meta = blockfiles.read(path, checksum)
        if meta.get("fingerprint") != self.fingerprint or meta.get("hash") != block:
            raise ValueError(f"block file {path} belongs to another model or block")
        return KVBlock.from_arrays(_to_mx(arrays), self._n_layers, BLOCK_TOKENS)

    def read_conversation(self, entry: cache_index.CacheEntry, agent_id: str, conversation_id: str,
                          in_memory: dict[str, KVBlock]) -> tuple[ConversationCache, dict[str, KVBlock]]:
        """A conversation's cache from its record file and the block files its index row
        lists (blocks already ``in_memory`` are not read again).

        Returns:
            The cache and the blocks read from disk.

        Raises:
            One of UNUSABLE: a file is missing or damaged, or the files disagree.
        """
        arrays, meta = blockfiles.read(self.local(entry.record_path))
        record = CacheRecord(tuple(int(t) for t in arrays["tokens"]), meta["text"],
                             tuple(int(e) for e in arrays["ends"]))
        chain = tuple(json.loads(meta["chain"]))
        if chain != tuple(b.hash for b in entry.blocks):
            raise ValueError("record file and index disagree on the block chain")
        loaded = {row.hash: self.read_block(row.hash, row.path, row.checksum or None)
                  for row in entry.blocks if row.hash not in in_memory}
        tail_tokens = int(meta["tail_tokens"])
        tail = None
        if tail_tokens:
            tail_arrays = {k.removeprefix("tail."): v for k, v in arrays.items() if k.startswith("tail.")}
            tail = KVBlock.from_arrays(_to_mx(tail_arrays), self._n_layers, tail_tokens)
        if len(chain) * BLOCK_TOKENS + tail_tokens != record.n_tokens:
            raise ValueError("blocks do not cover the record")
        return ConversationCache(agent_id, conversation_id, record, chain, tail), loaded

    def read_text(self, record_path: str) -> str:
        """The text a stored record spells (its header only, unverified: for matching;
        the whole file is verified before its KV data is used). Raises DamagedFile."""
        return blockfiles.read_metadata(self.local(record_path)).get("text", "")


def _numpy(block: KVBlock, prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + name: np.array(array, copy=False) for name, array in block.to_arrays().items()}


def _to_mx(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {name: mx.array(array) for name, array in arrays.items()}


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
        the shared tier if there is one)."""
        with self._lock:
            written = self._lock.wait_for(lambda: self._pending == 0, timeout_s)
        return written and (self._uploader is None or self._uploader.flush(timeout_s))

    def stop(self, timeout_s: float = 30) -> None:
        self._queue.put(None)
        self.join(timeout_s)
        if self._uploader is not None:
            self._uploader.stop(timeout_s)

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
                log.exception("persisting a cache failed (%s)", item)
            finally:
                done.set()
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _write(self, snapshot: Snapshot) -> None:
        cache = snapshot.cache
        record_path = self._files.write_record(cache)
        for _ in range(WRITE_ATTEMPTS):
            written = [self._files.write_block(block, snapshot.blocks[block]) for block in cache.chain]
            # Another writer (the worker, a second process) may hold the database: wait it out
            # as a finished turn's history does, rather than lose the cache's rows.
            indexed, previous = with_retries(lambda: self._index(cache, record_path, written, snapshot.epoch),
                                             INDEX_ATTEMPTS)
            if indexed is None:  # another server owns the agent now: its cache is the one that counts
                record_path.unlink(missing_ok=True)
                log.warning("conversation %s: not indexed, agent %s is owned by another server since",
                            cache.conversation_id, cache.agent_id)
                return
            if not indexed:
                continue
            # Only now: a crash before the commit leaves the previous record in force (and the new
            # file an orphan for the worker's compact), never a row without its file.
            if previous is not None and previous.record_path != str(record_path):
                self._files.local(previous.record_path, fetch=False).unlink(missing_ok=True)
            if self._uploader is not None:
                self._uploader.submit(Upload(tuple((self._files.key(path), path) for path, _ in written),
                                             (self._files.key(record_path), record_path)))
            return
        raise RuntimeError(f"the block files of conversation {cache.conversation_id} kept being deleted")

    def _index(self, cache: ConversationCache, record_path: Path, written: list[tuple[Path, str]],
               epoch: int | None) -> tuple[bool | None, cache_index.CacheEntry | None]:
        """Index the written files in one transaction: (False, None) if a block file was
        deleted meanwhile, (None, None) if this server no longer owns the agent (pool mode),
        else (True, the entry it replaced)."""
        with write_locked(self._sessions) as session:
            if self._owner is not None and epoch is not None and \
                    not ownership.still_owns(session, cache.agent_id, self._owner, epoch):
                return None, None
            # A block file that existed above may have been deleted since by the worker
            # (its row was dropped); under the lock no deleter runs, and after this
            # commit the rows protect the files.
            if not all(path.exists() for path, _ in written):
                return False, None
            rows = [cache_index.BlockRow(block, parent, BLOCK_TOKENS, str(path), path.stat().st_size, digest)
                    for block, parent, (path, digest) in zip(cache.chain, (None, *cache.chain), written)]
            now = utcnow()
            previous = cache_index.load_cache(session, cache.conversation_id, self._files.fingerprint)
            ensure_conversation(session, cache.conversation_id, cache.agent_id, "content", now)
            cache_index.save_cache(session, cache.agent_id, cache.conversation_id, self._files.fingerprint,
                                   cache.record.n_tokens, str(record_path), rows, now)
            return True, previous

    def _copy(self, item: Copy) -> None:
        """In one write-locked transaction, so the source's record cannot be replaced and
        deleted while it is read, nor its blocks dropped before the copy references them."""
        fingerprint = self._files.fingerprint
        with write_locked(self._sessions) as session:
            entry = cache_index.load_cache(session, item.source, fingerprint)
            if entry is None:
                return
            arrays, meta = blockfiles.read(self._files.local(entry.record_path))
            record_path = self._files.record_path(item.conversation_id)
            blockfiles.write(record_path, arrays, {**meta, "agent_id": item.agent_id,
                                                   "conversation_id": item.conversation_id})
            ensure_conversation(session, item.conversation_id, item.agent_id, "direct", utcnow())
            cache_index.save_cache(session, item.agent_id, item.conversation_id, fingerprint, entry.n_tokens,
                                   str(record_path), entry.blocks, utcnow())
        if self._uploader is not None:
            blocks = tuple((self._files.key(path), path) for path in (self._files.local(b.path, fetch=False)
                                                                     for b in entry.blocks) if path.exists())
            self._uploader.submit(Upload(blocks, (self._files.key(record_path), record_path)))

    def _forget(self, conversation_id: str) -> None:
        with self._sessions.begin() as session:
            entry = cache_index.load_cache(session, conversation_id, self._files.fingerprint)
            orphans = cache_index.drop_cache(session, conversation_id, self._files.fingerprint)
        paths = [entry.record_path] if entry else []
        for path in [*paths, *orphans]:
            Path(path).unlink(missing_ok=True)
