"""Staging: a turn's cache files brought from a pool's shared tier before the turn reaches
the engine thread, whose steps every running sequence waits on.

The engine owns one ``Stager`` and calls it from the request's thread with the fingerprint
of the model the request names (which may not be the model loaded now: the cache manager
of the loaded model would look up, and fetch, the wrong model's files). It reads the index
and writes files only, never a cache manager's memory; what it fetched is remembered by
path (``CacheFiles.take_fetched``), so the manager reports that turn's provenance as the tier.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from app.cache.files import CacheFiles
from app.store.cache_index import CacheIndex

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.cache.shared_tier import S3Tier


class Stager:
    """Fetches a conversation's missing files from ``tier`` into ``blocks_dir`` (None: no
    tier, nothing to stage)."""

    def __init__(self, blocks_dir: Path, sessions: sessionmaker[Session], tier: S3Tier | None) -> None:
        self._blocks_dir = blocks_dir
        self._sessions = sessions
        self._tier = tier
        self._by_fingerprint: dict[str, tuple[CacheIndex, CacheFiles]] = {}
        self._lock = threading.Lock()

    def stage(self, fingerprint: str, conversation_id: str) -> None:
        """Bring the files of ``conversation_id``'s cache for the model of cache fingerprint
        ``fingerprint`` from the tier, those not here already (side by side: the GETs wait on
        the network). Nothing stored, or no tier: nothing to do."""
        if self._tier is None:
            return
        with self._lock:
            if fingerprint not in self._by_fingerprint:
                self._by_fingerprint[fingerprint] = (CacheIndex(self._sessions, fingerprint),
                                                     CacheFiles(self._blocks_dir, fingerprint, self._tier))
            index, files = self._by_fingerprint[fingerprint]
        entry = index.load(conversation_id)
        if entry is not None:
            files.fetch_missing([entry.record_path, *(block.path for block in entry.blocks)])
