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


def save_cache(session: Session, agent_id: str, fingerprint: str, n_tokens: int, record_path: str,
               blocks: Sequence[BlockRow], now: datetime) -> None:
    """Record an agent's cache (replacing its previous block list)."""
    for row in blocks:
        existing = session.get(Block, row.hash)
        if existing is None:
            session.add(Block(hash=row.hash, model_fingerprint=fingerprint, parent_hash=row.parent_hash,
                              n_tokens=row.n_tokens, path=row.path, nbytes=row.nbytes, checksum=row.checksum,
                              ref_count=0, tier="warm", created_at=now, last_access_at=now))
        else:
            existing.last_access_at = now
    cache = session.scalar(select(Cache).where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint))
    if cache is None:
        cache = Cache(agent_id=agent_id, model_fingerprint=fingerprint, created_at=now, tier="warm",
                      n_tokens=0, updated_at=now, last_access_at=now)
        session.add(cache)
        session.flush()
    old = list(session.scalars(select(CacheBlock.block_hash).where(CacheBlock.cache_id == cache.id)))
    session.execute(delete(CacheBlock).where(CacheBlock.cache_id == cache.id))
    session.add_all(CacheBlock(cache_id=cache.id, position=i, block_hash=row.hash) for i, row in enumerate(blocks))
    session.flush()
    cache.n_tokens, cache.record_path, cache.updated_at, cache.last_access_at = n_tokens, record_path, now, now
    cache.tier = "warm"  # also revives a cache the worker expired while the server held it in memory
    _refresh_ref_counts(session, [*old, *(row.hash for row in blocks)])


def load_cache(session: Session, agent_id: str, fingerprint: str) -> CacheEntry | None:
    cache = session.scalar(select(Cache).where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint,
                                               Cache.tier != "cold"))
    if cache is None or cache.record_path is None:
        return None
    rows = session.execute(
        select(Block).join(CacheBlock, CacheBlock.block_hash == Block.hash)
        .where(CacheBlock.cache_id == cache.id).order_by(CacheBlock.position)
    ).scalars()
    blocks = tuple(BlockRow(b.hash, b.parent_hash, b.n_tokens, b.path or "", b.nbytes, b.checksum or "") for b in rows)
    return CacheEntry(cache.record_path, cache.n_tokens, blocks)


def drop_cache(session: Session, agent_id: str, fingerprint: str) -> list[str]:
    """Forget an agent's cache for one model.

    Returns:
        Paths of block files no cache references any more; their rows are
        deleted and the files are the caller's to delete.
    """
    cache = session.scalar(select(Cache).where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint))
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


def _drop_unreferenced(session: Session, hashes: Sequence[str]) -> list[str]:
    """Delete the rows of blocks among ``hashes`` no cache references; return their paths."""
    _refresh_ref_counts(session, hashes)
    orphans = []
    for block in session.scalars(select(Block).where(Block.hash.in_(hashes), Block.ref_count == 0)):
        if block.path:
            orphans.append(block.path)
        session.delete(block)
    return orphans


def candidates_for_chain(session: Session, fingerprint: str, chain: Sequence[str]) -> list[tuple[str, str, int]]:
    """Agents whose whole cached block chain is a prefix of ``chain``, longest first.

    Returns (agent id, record path, chain length) triples.
    """
    if not chain:
        return []
    found: list[tuple[str, str, int]] = []
    rows = session.execute(
        select(Cache.agent_id, Cache.record_path, func.count(CacheBlock.position), Cache.last_access_at)
        .join(CacheBlock, CacheBlock.cache_id == Cache.id)
        .where(Cache.model_fingerprint == fingerprint, Cache.tier != "cold",
               CacheBlock.position == 0, CacheBlock.block_hash == chain[0])
        .group_by(Cache.id)
    ).all()
    for agent_id, record_path, _, _ in rows:
        hashes = list(session.scalars(
            select(CacheBlock.block_hash).join(Cache, Cache.id == CacheBlock.cache_id)
            .where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint)
            .order_by(CacheBlock.position)))
        if hashes == list(chain[:len(hashes)]) and record_path:
            found.append((agent_id, record_path, len(hashes)))
    return sorted(found, key=lambda item: -item[2])


def caches_by_tier(session: Session) -> dict[str, int]:
    """Stored caches per tier (warm / cold), all models."""
    rows = session.execute(select(Cache.tier, func.count()).group_by(Cache.tier))
    return {tier: int(n) for tier, n in rows}


def count_caches(session: Session, fingerprint: str) -> int:
    """Agents with a stored (warm or hot) cache for this model."""
    return session.scalar(select(func.count()).select_from(Cache).where(
        Cache.model_fingerprint == fingerprint, Cache.tier != "cold")) or 0
