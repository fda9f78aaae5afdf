"""Background persistence of agent caches: block files, record files, SQL index.

The engine thread hands over immutable snapshots after a response; this
thread writes them, so persistence never adds to a response's latency. A
crash loses at most snapshots still queued (the newest turns' caches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from app.cache.blocks import KVBlock
from app.cache.records import CacheRecord
from app.store import blockfiles, cache_index
from app.store.history import utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """One agent's cache as it stands after a turn."""

    agent_id: str
    record: CacheRecord
    chain: tuple[str, ...]  # full blocks, in order
    tail: KVBlock | None  # private partial block
    blocks: dict[str, KVBlock]  # the chain's blocks; those not on disk yet get written


class CacheFiles:
    """Where an agent's files live under ``blocks/<fingerprint>/``."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root = root
        self.base = root / fingerprint[:16]
        self.fingerprint = fingerprint

    def block_path(self, block: str) -> Path:
        return self.base / block[:2] / f"{block}.safetensors"

    def record_path(self, agent_id: str) -> Path:
        return self.base / "agents" / f"{hashlib.sha256(agent_id.encode()).hexdigest()[:32]}.safetensors"


def _numpy(block: KVBlock, prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + name: np.array(array, copy=False) for name, array in block.to_arrays().items()}


def record_arrays(snapshot: Snapshot) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    arrays = {"tokens": np.array(snapshot.record.tokens, dtype=np.int64),
              "ends": np.array(snapshot.record.ends, dtype=np.int64)}
    if snapshot.tail is not None:
        arrays.update(_numpy(snapshot.tail, "tail."))
    metadata = {"agent_id": snapshot.agent_id, "text": snapshot.record.text,
                "chain": json.dumps(list(snapshot.chain)),
                "tail_tokens": str(snapshot.tail.n_tokens if snapshot.tail else 0)}
    return arrays, metadata


class Persister(threading.Thread):
    def __init__(self, files: CacheFiles, sessions: sessionmaker[Session]) -> None:
        super().__init__(name="semantic-persist", daemon=True)
        self._files = files
        self._sessions = sessions
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()

    def submit(self, snapshot: Snapshot) -> None:
        self._idle.clear()
        self._queue.put(snapshot)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far is on disk."""
        return self._idle.wait(timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        self._queue.put(None)
        self.join(timeout_s)

    def run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            try:
                self._write(snapshot)
            except Exception:  # a failed write is a future cache miss, never a crash
                log.exception("persisting the cache of agent %s failed", snapshot.agent_id)
            if self._queue.empty():
                self._idle.set()

    def _write(self, snapshot: Snapshot) -> None:
        fingerprint = self._files.fingerprint
        rows = []
        parent = None
        for block in snapshot.chain:
            path = self._files.block_path(block)
            digest = ""
            if not path.exists():
                data = snapshot.blocks[block]
                digest, _ = blockfiles.write(path, _numpy(data), {
                    "fingerprint": fingerprint, "hash": block, "n_tokens": str(data.n_tokens)})
            rows.append(cache_index.BlockRow(block, parent, snapshot.blocks[block].n_tokens, str(path),
                                             path.stat().st_size, digest))
            parent = block
        record_path = self._files.record_path(snapshot.agent_id)
        blockfiles.write(record_path, *record_arrays(snapshot))
        with self._sessions.begin() as session:
            cache_index.save_cache(session, snapshot.agent_id, fingerprint, snapshot.record.n_tokens,
                                   str(record_path), rows, utcnow())
