"""The SQL index of cache files: which agent holds which blocks of which model.

Functions take a Session and do not commit. Reference counts are recomputed
from ``cache_blocks`` for the blocks a change touched, so they cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.store.models import Block, Cache, CacheBlock


@dataclass(frozen=True, slots=True)
class BlockRow:
    hash: str
    parent_hash: str | None
    n_tokens: int
    path: str
    nbytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """What is needed to load an agent's cache from disk."""

    record_path: str
    n_tokens: int
    blocks: tuple[BlockRow, ...]


def _refresh_ref_counts(session: Session, hashes: Iterable[str]) -> None:
    for block_hash in set(hashes):
        count = session.scalar(select(func.count()).where(CacheBlock.block_hash == block_hash)) or 0
        block = session.get(Block, block_hash)
        if block is not None:
            block.ref_count = count


def save_cache(session: Session, agent_id: str, conversation_id: str, fingerprint: str, n_tokens: int,
               record_path: str, blocks: Sequence[BlockRow], now: datetime) -> None:
    """Record a conversation's cache (replacing its previous block list)."""
    for row in blocks:
        existing = session.get(Block, row.hash)
        if existing is None:
            session.add(Block(hash=row.hash, model_fingerprint=fingerprint, parent_hash=row.parent_hash,
                              n_tokens=row.n_tokens, path=row.path, nbytes=row.nbytes, checksum=row.checksum,
                              ref_count=0, tier="warm", created_at=now, last_access_at=now))
        else:
            existing.last_access_at = now
    cache = _cache(session, conversation_id, fingerprint)
    if cache is None:
        cache = Cache(agent_id=agent_id, conversation_id=conversation_id, model_fingerprint=fingerprint,
                      created_at=now, tier="warm", n_tokens=0, updated_at=now, last_access_at=now)
        session.add(cache)
        session.flush()
    old = list(session.scalars(select(CacheBlock.block_hash).where(CacheBlock.cache_id == cache.id)))
    session.execute(delete(CacheBlock).where(CacheBlock.cache_id == cache.id))
    session.add_all(CacheBlock(cache_id=cache.id, position=i, block_hash=row.hash) for i, row in enumerate(blocks))
    session.flush()
    cache.n_tokens, cache.record_path, cache.updated_at, cache.last_access_at = n_tokens, record_path, now, now
    cache.tier = "warm"  # also revives a cache the worker expired while the server held it in memory
    _refresh_ref_counts(session, [*old, *(row.hash for row in blocks)])


def _cache(session: Session, conversation_id: str, fingerprint: str) -> Cache | None:
    return session.scalar(select(Cache).where(Cache.conversation_id == conversation_id,
                                              Cache.model_fingerprint == fingerprint))


def load_cache(session: Session, conversation_id: str, fingerprint: str) -> CacheEntry | None:
    cache = _cache(session, conversation_id, fingerprint)
    if cache is None or cache.tier == "cold" or cache.record_path is None:
        return None
    rows = session.execute(
        select(Block).join(CacheBlock, CacheBlock.block_hash == Block.hash)
        .where(CacheBlock.cache_id == cache.id).order_by(CacheBlock.position)
    ).scalars()
    blocks = tuple(BlockRow(b.hash, b.parent_hash, b.n_tokens, b.path or "", b.nbytes, b.checksum or "") for b in rows)
    return CacheEntry(cache.record_path, cache.n_tokens, blocks)


def agent_caches(session: Session, agent_id: str, fingerprint: str) -> list[tuple[str, str]]:
    """The agent's stored (warm) conversation caches for one model, most recently used
    first, as (conversation id, record path)."""
    rows = session.execute(select(Cache.conversation_id, Cache.record_path)
                           .where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint,
                                  Cache.tier != "cold", Cache.record_path.is_not(None))
                           .order_by(Cache.last_access_at.desc()))
    return [(conversation_id, path) for conversation_id, path in rows]


def recent_caches(session: Session, fingerprint: str, since: datetime, limit: int) -> list[tuple[str, str]]:
    """(agent id, conversation id) of the stored caches of one model used since ``since``,
    most recently used first, at most ``limit``."""
    rows = session.execute(select(Cache.agent_id, Cache.conversation_id)
                           .where(Cache.model_fingerprint == fingerprint, Cache.tier != "cold",
                                  Cache.record_path.is_not(None), Cache.last_access_at >= since)
                           .order_by(Cache.last_access_at.desc()).limit(limit))
    return [(agent_id, conversation_id) for agent_id, conversation_id in rows]


def block_file(session: Session, block_hash: str) -> tuple[str, str | None] | None:
    """(path, checksum) of a stored block, if it has a file."""
    block = session.get(Block, block_hash)
    return (block.path, block.checksum or None) if block is not None and block.path else None


def drop_cache(session: Session, conversation_id: str, fingerprint: str) -> list[str]:
    """Forget a conversation's cache for one model.

    Returns:
        Paths of block files no cache references any more; their rows are
        deleted and the files are the caller's to delete.
    """
    cache = _cache(session, conversation_id, fingerprint)
    if cache is None:
        return []
    hashes = list(session.scalars(select(CacheBlock.block_hash).where(CacheBlock.cache_id == cache.id)))
    session.delete(cache)
    session.flush()
    return _drop_unreferenced(session, hashes)


def retire_cache(session: Session, cache: Cache) -> list[str]:
    """Warm -> cold: the cache row stays (tier cold, no blocks, no record file).

    Returns:
        Paths of files to delete: its record file and the block files no
        other cache references (their rows are deleted).
    """
    hashes = list(session.scalars(select(CacheBlock.block_hash).where(CacheBlock.cache_id == cache.id)))
    session.execute(delete(CacheBlock).where(CacheBlock.cache_id == cache.id))
    session.flush()
    files = [cache.record_path] if cache.record_path else []
    cache.tier, cache.record_path, cache.n_tokens = "cold", None, 0
    return files + _drop_unreferenced(session, hashes)


def referenced_paths(session: Session, paths: Sequence[str]) -> set[str]:
    """Those of ``paths`` a block or cache row points to."""
    found: set[str] = set()
    for start in range(0, len(paths), 500):  # SQLite bounds the parameters of one statement
        chunk = paths[start:start + 500]
        found.update(session.scalars(select(Block.path).where(Block.path.in_(chunk))))
        found.update(session.scalars(select(Cache.record_path).where(Cache.record_path.in_(chunk))))
    return found


def _drop_unreferenced(session: Session, hashes: Sequence[str]) -> list[str]:
    """Delete the rows of blocks among ``hashes`` no cache references; return their paths."""
    _refresh_ref_counts(session, hashes)
    orphans = []
    for block in session.scalars(select(Block).where(Block.hash.in_(hashes), Block.ref_count == 0)):
        if block.path:
            orphans.append(block.path)
        session.delete(block)
    return orphans


def caches_by_tier(session: Session) -> dict[str, int]:
    """Stored caches per tier (warm / cold), all models."""
    rows = session.execute(select(Cache.tier, func.count()).group_by(Cache.tier))
    return {tier: int(n) for tier, n in rows}


def count_caches(session: Session, fingerprint: str) -> int:
    """Agents with a stored (warm or hot) cache for this model."""
    return session.scalar(select(func.count()).select_from(Cache).where(
        Cache.model_fingerprint == fingerprint, Cache.tier != "cold")) or 0
