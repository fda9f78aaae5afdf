"""BlockPool: reference counts, byte accounting and LRU order of the hot tier. Pure.

It holds no arrays, only ids and sizes: the manager keeps the arrays and asks
the pool what to drop. Agents reference the blocks of their chains; a block
whose count falls to zero leaves memory (it is on disk). When the pool is over
budget, the least recently used agents are the ones to spill.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class BlockPool:
    budget_bytes: int
    _refs: Counter[str] = field(default_factory=Counter)
    _sizes: dict[str, int] = field(default_factory=dict)
    _agents: "OrderedDict[str, int]" = field(default_factory=OrderedDict)  # agent -> private bytes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values()) + sum(self._agents.values())

    @property
    def n_blocks(self) -> int:
        return len(self._sizes)

    def contains(self, block: str) -> bool:
        return block in self._sizes

    def add_block(self, block: str, nbytes: int) -> None:
        self._sizes.setdefault(block, nbytes)

    def assign(self, agent: str, blocks: Iterable[str], private_bytes: int, previous: Iterable[str] = ()) -> list[str]:
        """Point ``agent`` at ``blocks`` (replacing ``previous``); mark it most recent.

        Returns:
            Blocks no agent references any more (the caller frees them).
        """
        for block in blocks:
            assert block in self._sizes, "blocks are added before they are referenced"
            self._refs[block] += 1
        self._agents[agent] = private_bytes
        self._agents.move_to_end(agent)
        return self._release(previous)

    def set_private(self, agent: str, nbytes: int) -> None:
        """What a hot agent holds besides shared blocks (its tail, its float working copy)."""
        if agent in self._agents:
            self._agents[agent] = nbytes

    def touch(self, agent: str) -> None:
        if agent in self._agents:
            self._agents.move_to_end(agent)

    def remove_agent(self, agent: str, blocks: Iterable[str]) -> list[str]:
        """Forget a hot agent; returns blocks that became unreferenced."""
        self._agents.pop(agent, None)
        return self._release(blocks)

    def over_budget(self) -> bool:
        return self.nbytes > self.budget_bytes

    def lru_agents(self, keep: str | None = None) -> list[str]:
        """Hot agents, least recently used first, without ``keep``."""
        return [agent for agent in self._agents if agent != keep]

    def _release(self, blocks: Iterable[str]) -> list[str]:
        freed = []
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, "reference counts never go negative"
            if self._refs[block] == 0:
                del self._refs[block]
                self._sizes.pop(block, None)
                freed.append(block)
        return freed
