"""Invariants of a SEMANTIC_HOME that must hold after any crash and restart.

- every cache row that is not cold has a record file that exists and verifies, and so does every block file
  a cache lists (nothing that is served can be half written);
- a block's ref_count equals the number of cache rows that list it;
- each conversation's message positions are 0..n-1, with no gap or repeat.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.cache import files as blockfiles
from app.store.db import make_engine


def store_problems(home: Path, url: str | None = None) -> list[str]:
    """What is wrong with the store at ``home`` (empty when every invariant holds); ``url``
    names the database when it is not ``home``'s SQLite file (PostgreSQL)."""
    engine = make_engine(url or f"sqlite:///{home / 'semantic.db'}", poolclass=NullPool)
    try:
        with engine.connect() as connection:
            caches = connection.execute(text(
                "SELECT id, conversation_id, record_path FROM caches WHERE tier != 'cold'")).all()
            listed = connection.execute(text(
                "SELECT cb.cache_id, b.hash, b.path, b.checksum FROM cache_blocks cb "
                "LEFT JOIN blocks b ON b.hash = cb.block_hash")).all()
            counts = connection.execute(text("SELECT hash, ref_count FROM blocks")).all()
            rows = connection.execute(text(
                "SELECT conversation_id, position FROM messages ORDER BY conversation_id, position")).all()
    finally:
        engine.dispose()
    positions: dict[str, list[int]] = {}
    for conversation, position in rows:
        positions.setdefault(conversation, []).append(int(position))
    problems = []
    for cache_id, conversation, record_path in caches:
        problems += _unreadable(f"cache {cache_id} ({conversation}) record", record_path, None)
    references: Counter[str] = Counter()
    for cache_id, block, path, checksum in listed:
        if block is None:
            problems.append(f"cache {cache_id} lists a block with no row")
            continue
        references[block] += 1
        problems += _unreadable(f"block {block[:12]} of cache {cache_id}", path, checksum)
    problems += [f"block {block[:12]}: ref_count {count}, referenced {references[block]} times"
                 for block, count in counts if count != references[block]]
    for conversation, found in positions.items():
        if found != list(range(len(found))):
            problems.append(f"conversation {conversation}: message positions {found}")
    return problems


def _unreadable(what: str, path: str | None, checksum: str | None) -> list[str]:
    if not path or not Path(path).exists():
        return [f"{what}: file {path} is missing"]
    try:
        blockfiles.read(Path(path), checksum)
    except blockfiles.DamagedFile as exc:
        return [f"{what}: {exc}"]
    return []
