"""The SQL index of cache files: which agent holds which blocks of which model. Every
query of the cache tables is here.

Functions take a Session and do not commit. Reference counts are recomputed
from ``cache_blocks`` for the blocks a change touched, so they cannot drift.
``CacheIndex`` asks the questions of the cache manager, each in a short session of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import delete, distinct, func, select
from sqlalchemy.orm import Session, sessionmaker

from app.store import ownership
from app.store.models import Agent, Block, Cache, CacheBlock, Conversation


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
    """What is needed to load a conversation's cache from disk."""

    record_path: str
    n_tokens: int
    blocks: tuple[BlockRow, ...]
    record_checksum: str | None = None  # None: a row from before revision 0008


def _refresh_ref_counts(session: Session, hashes: Iterable[str]) -> None:
    for block_hash in set(hashes):
        count = session.scalar(select(func.count()).where(CacheBlock.block_hash == block_hash)) or 0
        block = session.get(Block, block_hash)
        if block is not None:
            block.ref_count = count


def save_cache(session: Session, agent_id: str, conversation_id: str, fingerprint: str, n_tokens: int,
               record_path: str, blocks: Sequence[BlockRow], now: datetime, *, record_checksum: str | None) -> None:
    """Record a conversation's cache (replacing its previous block list): its record file
    and that file's checksum, and its blocks. A block row that exists keeps its file and
    checksum, unless it has none (a row from before files were verified when adopted) or
    ``row`` names the same file: then it takes ``row``'s checksum, which the caller wrote
    or checked that file against (``CacheFiles.write_block``)."""
    for row in blocks:
        existing = session.get(Block, row.hash)
        if existing is None:
            session.add(Block(hash=row.hash, model_fingerprint=fingerprint, parent_hash=row.parent_hash,
                              n_tokens=row.n_tokens, path=row.path, nbytes=row.nbytes, checksum=row.checksum,
                              ref_count=0, tier="warm", created_at=now, last_access_at=now))
        else:
            existing.last_access_at = now
            if row.checksum and (not existing.checksum or existing.path == row.path):
                existing.path, existing.nbytes, existing.checksum = row.path, row.nbytes, row.checksum
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
    cache.record_checksum = record_checksum
    cache.tier = "warm"  # also revives a cache the worker expired while the server held it in memory
    _refresh_ref_counts(session, [*old, *(row.hash for row in blocks)])


def has_conversation(session: Session, conversation_id: str) -> bool:
    """Whether the conversation a cache would belong to exists: the history writer
    (``history.py``) creates it before the engine computes a cache for it, and a cache row
    references it (a deleted one takes no cache)."""
    return session.get(Conversation, conversation_id) is not None


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
    return CacheEntry(cache.record_path, cache.n_tokens, blocks, cache.record_checksum)


def agent_caches(session: Session, agent_id: str, fingerprint: str) -> list[tuple[str, str]]:
    """The agent's stored (warm) conversation caches for one model, most recently used
    first, as (conversation id, record path)."""
    rows = session.execute(select(Cache.conversation_id, Cache.record_path)
                           .where(Cache.agent_id == agent_id, Cache.model_fingerprint == fingerprint,
                                  Cache.tier != "cold", Cache.record_path.is_not(None))
                           .order_by(Cache.last_access_at.desc()))
    return [(conversation_id, path) for conversation_id, path in rows if path is not None]


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


@dataclass(frozen=True, slots=True)
class SharedCheckpoint:
    """A block's shared checkpoint file (hybrid models): the recurrent state after its tokens."""

    block: str
    path: str
    checksum: str
    nbytes: int


def block_checkpoints(session: Session, hashes: Collection[str]) -> dict[str, SharedCheckpoint]:
    """The shared checkpoints the rows of these blocks name (blocks without one left out)."""
    found: dict[str, SharedCheckpoint] = {}
    wanted = list(hashes)
    for start in range(0, len(wanted), 500):  # SQLite bounds the parameters of one statement
        found.update((h, SharedCheckpoint(h, p, c, n or 0)) for h, p, c, n in session.execute(
            select(Block.hash, Block.checkpoint_path, Block.checkpoint_checksum, Block.checkpoint_nbytes)
            .where(Block.hash.in_(wanted[start:start + 500]))) if p and c)
    return found


def save_block_checkpoints(session: Session, checkpoints: Iterable[SharedCheckpoint]) -> None:
    """Point blocks' rows at their shared checkpoint files (the blocks' rows must exist: the
    same transaction's ``save_cache`` adds them). A row that names another file gets this one."""
    for point in checkpoints:
        block = session.get(Block, point.block)
        if block is not None:
            block.checkpoint_path, block.checkpoint_checksum = point.path, point.checksum
            block.checkpoint_nbytes = point.nbytes


def block_checksums(session: Session, hashes: Collection[str]) -> dict[str, str]:
    """The checksum each of these blocks' rows holds (blocks without a row or a checksum left out)."""
    found: dict[str, str] = {}
    wanted = list(hashes)
    for start in range(0, len(wanted), 500):  # SQLite bounds the parameters of one statement
        found.update((h, c) for h, c in session.execute(
            select(Block.hash, Block.checksum).where(Block.hash.in_(wanted[start:start + 500]))) if c)
    return found


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
    cache.tier, cache.record_path, cache.record_checksum, cache.n_tokens = "cold", None, None, 0
    return files + _drop_unreferenced(session, hashes)


def referenced_paths(session: Session, paths: Sequence[str]) -> set[str]:
    """Those of ``paths`` a block or cache row points to."""
    found: set[str] = set()
    for start in range(0, len(paths), 500):  # SQLite bounds the parameters of one statement
        chunk = paths[start:start + 500]
        found.update(session.scalars(select(Block.path).where(Block.path.in_(chunk))))
        found.update(session.scalars(select(Block.checkpoint_path).where(Block.checkpoint_path.in_(chunk))))
        found.update(session.scalars(select(Cache.record_path).where(Cache.record_path.in_(chunk))))
    return found


def _files_of(block: Block) -> list[str]:
    """A block row's files: the block's, and its shared checkpoint's if it has one."""
    return [path for path in (block.path, block.checkpoint_path) if path]


def _drop_unreferenced(session: Session, hashes: Sequence[str]) -> list[str]:
    """Delete the rows of blocks among ``hashes`` no cache references; return their paths."""
    _refresh_ref_counts(session, hashes)
    orphans = []
    for block in session.scalars(select(Block).where(Block.hash.in_(hashes), Block.ref_count == 0)):
        orphans += _files_of(block)
        session.delete(block)
    return orphans


# Where a conversation's cache is. The one definition, for a conversation (``tier_of``) and
# counted over all of them (``count_tiers``): hot = in a server's memory (which the server
# knows, not the store); warm = not hot, and a cache of it is on disk for some model (a row
# whose tier is not cold); cold = neither, its caches made cold (files deleted, history kept).
Tier = Literal["hot", "warm", "cold"]


@dataclass(frozen=True, slots=True)
class TierCounts:
    """Conversations by tier (see ``Tier``)."""

    hot: int
    warm: int
    cold: int


def tier_of(in_memory: bool, stored_tiers: Iterable[str]) -> Tier:
    """A conversation's tier, given whether it is in memory and its caches rows' tiers."""
    return "hot" if in_memory else "warm" if set(stored_tiers) - {"cold"} else "cold"


def count_tiers(session: Session, hot: Collection[str]) -> TierCounts:
    """Conversations per tier, all models; ``hot``: the conversations held in memory."""
    others = Cache.conversation_id.not_in(list(hot))
    on_disk = select(Cache.conversation_id).where(Cache.tier != "cold")
    warm = session.scalar(select(func.count(distinct(Cache.conversation_id))).where(others, Cache.tier != "cold"))
    cold = session.scalar(select(func.count(distinct(Cache.conversation_id)))
                          .where(others, Cache.conversation_id.not_in(on_disk)))
    return TierCounts(len(hot), warm or 0, cold or 0)


def conversation_caches(session: Session, conversation_id: str) -> list[tuple[str, CacheEntry]]:
    """(model fingerprint, entry) of the conversation's stored caches, one per model."""
    found = []
    for fingerprint in session.scalars(select(Cache.model_fingerprint).where(Cache.conversation_id == conversation_id)):
        entry = load_cache(session, conversation_id, fingerprint)
        if entry is not None:
            found.append((fingerprint, entry))
    return found


def agents_caches(session: Session, agent_ids: Sequence[str]) -> list[tuple[str, str, int, str]]:
    """(conversation id, model fingerprint, tokens, tier) of every cache of these agents."""
    return [(c, fp, n, tier) for c, fp, n, tier in session.execute(
        select(Cache.conversation_id, Cache.model_fingerprint, Cache.n_tokens, Cache.tier)
        .where(Cache.agent_id.in_(agent_ids)))]


# -- what the worker's jobs ask ---------------------------------------------------------------

def _file_size(path: str | None) -> int:
    try:
        return Path(path).stat().st_size if path else 0
    except FileNotFoundError:
        return 0


def disk_bytes(session: Session) -> int:
    """Bytes of cache files the index points to (blocks, their shared checkpoints, records)."""
    blocks = session.scalar(select(func.coalesce(func.sum(Block.nbytes), 0)).where(Block.path.is_not(None))) or 0
    blocks += session.scalar(select(func.coalesce(func.sum(Block.checkpoint_nbytes), 0))
                             .where(Block.checkpoint_path.is_not(None))) or 0
    records = session.scalars(select(Cache.record_path).where(Cache.record_path.is_not(None)))
    return int(blocks) + sum(_file_size(path) for path in records)


def files_size(paths: Iterable[str]) -> int:
    """Bytes the files among ``paths`` that exist hold."""
    return sum(_file_size(path) for path in paths)


def expired_caches(session: Session, default_ttl_s: int, now: datetime) -> list[Cache]:
    """The warm caches whose agent was last used longer ago than its TTL (the agent's
    ``ttl_seconds``, else ``default_ttl_s``)."""
    rows = session.execute(select(Cache, Agent.ttl_seconds, Agent.last_access_at)
                           .join(Agent, Agent.id == Cache.agent_id).where(Cache.tier != "cold")).all()
    return [cache for cache, ttl, agent_access in rows
            if max(cache.last_access_at, agent_access)
            + timedelta(seconds=default_ttl_s if ttl is None else ttl) <= now]


def warm_caches_oldest_first(session: Session) -> Iterator[Cache]:
    """The warm caches, least recently used first."""
    return iter(session.scalars(select(Cache).where(Cache.tier != "cold").order_by(Cache.last_access_at)))


def unreferenced_blocks(session: Session, before: datetime) -> list[str]:
    """Hashes of blocks no cache references (an agent's chain moved on), unused since ``before``."""
    return list(session.scalars(select(Block.hash).where(Block.ref_count == 0, Block.last_access_at < before)))


def drop_blocks(session: Session, hashes: list[str], before: datetime) -> list[str]:
    """Delete those of ``hashes`` still unreferenced and unused (the server may have
    taken one back since they were read); returns their files."""
    paths = []
    for start in range(0, len(hashes), 500):  # SQLite bounds the parameters of one statement
        stale = list(session.scalars(select(Block).where(Block.hash.in_(hashes[start:start + 500]),
                                                         Block.ref_count == 0, Block.last_access_at < before)))
        for block in stale:
            session.delete(block)
            paths += _files_of(block)
    return paths


def files_by_model(session: Session) -> list[tuple[str, str]]:
    """(path, model fingerprint) of every file a block or cache row points to."""
    return [*session.execute(select(Block.path, Block.model_fingerprint).where(Block.path.is_not(None))),
            *session.execute(select(Block.checkpoint_path, Block.model_fingerprint)
                             .where(Block.checkpoint_path.is_not(None))),
            *session.execute(select(Cache.record_path, Cache.model_fingerprint).where(Cache.record_path.is_not(None)))]


def known_paths(session: Session) -> set[str]:
    """Every file a block or cache row points to."""
    known = set(session.scalars(select(Block.path).where(Block.path.is_not(None))))
    known |= set(session.scalars(select(Block.checkpoint_path).where(Block.checkpoint_path.is_not(None))))
    known |= set(session.scalars(select(Cache.record_path).where(Cache.record_path.is_not(None))))
    return {path for path in known if path is not None}


def block_files(session: Session) -> list[tuple[str, str, str | None]]:
    """(hash, path, checksum) of every block with a file."""
    return [(h, p, c) for h, p, c in session.execute(
        select(Block.hash, Block.path, Block.checksum).where(Block.path.is_not(None))) if p is not None]


def record_files(session: Session) -> list[tuple[int, str]]:
    """(cache id, path) of every record file."""
    return [(i, p) for i, p in session.execute(select(Cache.id, Cache.record_path)
                                                .where(Cache.record_path.is_not(None))) if p is not None]


def caches_needing(session: Session, damaged_blocks: list[tuple[str, str]],
                   damaged_records: list[tuple[int, str]]) -> set[Cache]:
    """The caches that still need one of these (hash, path) block files or (cache id, path)
    record files: their row still points at that file (a turn that wrote new files since
    does not)."""
    hashes = [h for h, path in damaged_blocks if session.scalar(select(Block.path).where(Block.hash == h)) == path]
    users = set(session.scalars(select(Cache).join(CacheBlock, CacheBlock.cache_id == Cache.id)
                                .where(CacheBlock.block_hash.in_(hashes)))) if hashes else set()
    for cache_id, path in damaged_records:
        users |= set(session.scalars(select(Cache).where(Cache.id == cache_id, Cache.record_path == path)))
    return users


class CacheIndex:
    """One model's cache index (``fingerprint``) as the cache manager reads it, and the
    ownership of agents in a pool (``app.store.ownership``)."""

    def __init__(self, sessions: sessionmaker[Session], fingerprint: str) -> None:
        self.sessions = sessions  # also the background writer's (``cache.persist``)
        self.fingerprint = fingerprint

    def agent_caches(self, agent_id: str) -> list[tuple[str, str]]:
        """See ``agent_caches``."""
        with self.sessions() as session:
            return agent_caches(session, agent_id, self.fingerprint)

    def load(self, conversation_id: str) -> CacheEntry | None:
        """The conversation's stored cache, if it has one (see ``load_cache``)."""
        with self.sessions() as session:
            return load_cache(session, conversation_id, self.fingerprint)

    def agent_of(self, conversation_id: str) -> str | None:
        """The agent of the conversation's stored cache (None: it has none)."""
        with self.sessions() as session:
            return session.scalar(select(Cache.agent_id).where(Cache.conversation_id == conversation_id,
                                                                Cache.model_fingerprint == self.fingerprint))

    def block_file(self, block_hash: str) -> tuple[str, str | None] | None:
        """See ``block_file``."""
        with self.sessions() as session:
            return block_file(session, block_hash)

    def block_checkpoints(self, hashes: Collection[str]) -> dict[str, SharedCheckpoint]:
        """See ``block_checkpoints``."""
        with self.sessions() as session:
            return block_checkpoints(session, hashes)

    def block_checksums(self, hashes: Collection[str]) -> dict[str, str]:
        """See ``block_checksums``."""
        with self.sessions() as session:
            return block_checksums(session, hashes)

    def recent(self, since: datetime, limit: int) -> list[tuple[str, str]]:
        """See ``recent_caches``."""
        with self.sessions() as session:
            return recent_caches(session, self.fingerprint, since, limit)

    def owner(self, agent_id: str) -> tuple[str, int] | None:
        """See ``ownership.current``."""
        with self.sessions() as session:
            return ownership.current(session, agent_id)

    def claim(self, agent_id: str, server_id: str, now: datetime) -> int:
        """See ``ownership.claim``."""
        return ownership.claim(self.sessions, agent_id, server_id, now)

    def release_all(self, server_id: str, now: datetime) -> int:
        """See ``ownership.release_all``."""
        return ownership.release_all(self.sessions, server_id, now)
