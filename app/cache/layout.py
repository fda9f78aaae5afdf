"""Where a model's cache files live, as paths and as object keys of a pool's shared tier. No MLX.

Under ``<root>/<fingerprint[:16]>/``: one file per full block (content-addressed:
``<hash[:2]>/<hash>.safetensors``) and one record file per conversation and version
(``conversations/<sha256(id)[:32]>-<random>.safetensors``). In a pool the index rows may
name another server's root: the same layout, mapped onto this server's.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from pathlib import Path

from app.cache.shared_tier import S3Tier

log = logging.getLogger(__name__)


def tier_key(stored: str | Path, fingerprint: str) -> str | None:
    """The object key of the file an index row names (whichever server's root it is under),
    or None if the path is not under a ``<fingerprint[:16]>`` directory."""
    parts = Path(stored).parts
    tag = fingerprint[:16]
    return "/".join(parts[parts.index(tag):]) if tag in parts else None


class FileLayout:
    def __init__(self, root: Path, fingerprint: str, tier: S3Tier | None = None) -> None:
        self.root = root
        self.base = root / fingerprint[:16]
        self.fingerprint = fingerprint
        self.tier = tier

    def key(self, path: Path) -> str:
        """A file's name in the shared tier: its path below the root (``<fingerprint[:16]>/...``)."""
        return path.relative_to(self.root).as_posix()

    def local(self, stored: str | Path, fetch: bool = True) -> Path:
        """Where this server keeps the file an index row names (the row may have been written by
        another server of a pool: same layout, another root). Missing here and ``fetch``: copied
        from the shared tier first, if there is one and it holds the file."""
        key = tier_key(stored, self.fingerprint)
        local = self.root.joinpath(*key.split("/")) if key is not None else Path(stored)
        if fetch and self.tier is not None and not local.exists():
            try:
                if self.tier.fetch(self.key(local), local):
                    log.info("restored %s from the shared tier", self.key(local))
            except Exception as exc:  # the tier is down: the file is missing, a miss
                log.warning("shared tier: %s not fetched (%s)", self.key(local), exc)
        return local

    def block_path(self, block: str) -> Path:
        return self.base / block[:2] / f"{block}.safetensors"

    def record_path(self, conversation_id: str) -> Path:
        """A new file for the conversation's record: records are versioned (the old one is
        deleted only after the row pointing to the new one is committed)."""
        name = hashlib.sha256(conversation_id.encode()).hexdigest()[:32]
        return self.base / "conversations" / f"{name}-{uuid.uuid4().hex[:12]}.safetensors"
