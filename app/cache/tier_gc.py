"""Garbage collection in a pool's shared tier: objects no index row names any more.

The worker deletes a cache's rows and its local files (expire, evict, compact); the
copies in the bucket stay until this job lists the bucket and deletes the objects that
no ``blocks`` or ``caches`` row names, once they are older than a grace period (an
object is uploaded after its row commits, so a young one may belong to a row this job
did not see). The bucket is listed before the rows are read. A block dropped and then
stored again by a server in the moment between the two can lose its object: the next
server to need it misses (a cold prefill: every object is verified before use), it is
never a wrong answer.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.cache.files import tier_key
from app.cache.shared_tier import S3Tier
from app.store import cache_index

GRACE = timedelta(minutes=10)


def referenced_keys(session: Session) -> set[str]:
    """The object keys of every file a row names (blocks and conversation records)."""
    return {key for path, fingerprint in cache_index.files_by_model(session)
            if (key := tier_key(path, fingerprint)) is not None}


def collect(sessions: sessionmaker[Session], tier: S3Tier, grace: timedelta = GRACE,
            now: datetime | None = None) -> dict[str, Any]:
    """Delete the tier's objects no row names, written more than ``grace`` ago."""
    now = now or datetime.now(UTC)
    listed = list(tier.listing())
    with sessions() as session:
        referenced = referenced_keys(session)
    doomed = [key for key, written in listed if key not in referenced and now - written > grace]
    deleted = tier.delete(doomed) if doomed else 0
    return {"objects": len(listed), "unreferenced": len(doomed), "deleted": deleted}
