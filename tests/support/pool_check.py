"""What tests ask of a ``BlockPool`` beyond what the cache manager does."""

from __future__ import annotations

from app.cache.pool import BlockPool


def holds(pool: BlockPool, block: str) -> bool:
    """Whether ``block`` is in memory (referenced or free)."""
    return block in pool._sizes


def check_pool(pool: BlockPool) -> None:
    """The pool's invariants: every block is referenced or free, never both."""
    assert set(pool._refs) | set(pool._free) == set(pool._sizes)
    assert not set(pool._refs) & set(pool._free)
    assert all(n > 0 for n in pool._refs.values())
