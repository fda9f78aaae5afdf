"""BlockPool: reference counts, byte accounting and LRU order of the hot tier. Pure.

It holds no arrays, only ids and sizes: the manager keeps the arrays and asks
the pool what to drop. Owners (conversations) reference the blocks of their
chains and hold private bytes of their own (a partial tail block, a float
working copy). A block no owner references stays cached, in an LRU of free
blocks, so a later request with the same prefix can still share it; under
budget pressure free blocks go first, then the least recently used owners.

``RecentWithin`` keeps the most recently used values of another kind (a hybrid model's
shared checkpoints, a draft model's caches) within a byte bound of their own.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


@dataclass
class BlockPool:
    budget_bytes: int
    _refs: Counter[str] = field(default_factory=Counter)
    _sizes: dict[str, int] = field(default_factory=dict)
    _free: OrderedDict[str, None] = field(default_factory=OrderedDict)  # unreferenced, least recent first
    _owners: OrderedDict[str, int] = field(default_factory=OrderedDict)  # owner -> private bytes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values()) + sum(self._owners.values())

    @property
    def n_blocks(self) -> int:
        return len(self._sizes)

    @property
    def n_free_blocks(self) -> int:
        return len(self._free)

    def add_block(self, block: str, nbytes: int) -> None:
        """A block now held in memory, referenced by nobody yet (most recent free block)."""
        if block not in self._sizes:
            self._sizes[block] = nbytes
            self._free[block] = None

    def touch_block(self, block: str) -> None:
        """A free block was used (read for sharing): it becomes the most recent."""
        if block in self._free:
            self._free.move_to_end(block)

    def assign(self, owner: str, blocks: Iterable[str], private_bytes: int, previous: Iterable[str] = ()) -> None:
        """Point ``owner`` at ``blocks`` (replacing ``previous``); mark it most recent."""
        for block in blocks:
            assert block in self._sizes, "blocks are added before they are referenced"
            self._refs[block] += 1
            self._free.pop(block, None)
        self._owners[owner] = private_bytes
        self._owners.move_to_end(owner)
        self._release(previous)

    def set_private(self, owner: str, nbytes: int) -> None:
        """What a hot owner holds besides shared blocks (its tail, its float working copy)."""
        if owner in self._owners:
            self._owners[owner] = nbytes

    def touch(self, owner: str) -> None:
        if owner in self._owners:
            self._owners.move_to_end(owner)

    def remove_owner(self, owner: str, blocks: Iterable[str]) -> None:
        """Forget a hot owner; its blocks no one else references become free."""
        self._owners.pop(owner, None)
        self._release(blocks)

    def over_budget(self) -> bool:
        return self.nbytes > self.budget_bytes

    def evict_free(self) -> list[str]:
        """Drop free blocks, least recently used first, until within budget.

        Returns:
            The blocks dropped (the caller frees their arrays).
        """
        dropped = []
        while self.over_budget() and self._free:
            block, _ = self._free.popitem(last=False)
            del self._sizes[block]
            dropped.append(block)
        return dropped

    def lru_owners(self, keep: str | None = None) -> list[str]:
        """Hot owners, least recently used first, without ``keep``."""
        return [owner for owner in self._owners if owner != keep]

    def _release(self, blocks: Iterable[str]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, "reference counts never go negative"
            if self._refs[block] == 0:
                del self._refs[block]
                self._free[block] = None


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=Sized)


class RecentWithin(Generic[V]):
    """The most recently used values by key, dropping the least recently used while their
    bytes exceed ``budget_bytes``; the latest value kept stays, whatever its size (a lease
    about to use it must not read it again)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._values: OrderedDict[str, V] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> V | None:
        return self._values.get(key)

    def take(self, key: str) -> V | None:
        """The value of ``key``, no longer kept (None if it is not)."""
        value = self._values.pop(key, None)
        if value is not None:
            self.nbytes -= value.nbytes
        return value

    def keep(self, key: str, value: V) -> list[str]:
        """Hold ``value`` as the most recently used. Returns the keys dropped to stay within
        the bound, least recently used first."""
        old = self._values.pop(key, None)
        self.nbytes += value.nbytes - (old.nbytes if old is not None else 0)
        self._values[key] = value
        dropped = []
        while self.nbytes > self.budget_bytes and len(self._values) > 1:
            gone, first = self._values.popitem(last=False)
            self.nbytes -= first.nbytes
            dropped.append(gone)
        return dropped
