"""What the cache manager holds in memory: 4-bit blocks by id, the hot conversations' caches,
float working copies of the most recent ones, and the pool's byte budget over all of them.

Hot -> warm happens here (``spill``: over budget, or a hot TTL passed); what a spilled
conversation held is on disk already or queued for the writer, so memory only lets it go.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from app.cache.blocks import KVBlock, cache_nbytes, overwrite_with_stored
from app.cache.formats import KVFormat
from app.cache.pool import BlockPool
from app.cache.records import ConversationCache
from app.types import CacheSource

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

log = logging.getLogger(__name__)


class HotSet:
    def __init__(self, budget_bytes: int, working_copies: int, kv_format: KVFormat) -> None:
        self.pool = BlockPool(budget_bytes)
        self.blocks: dict[str, KVBlock] = {}
        self.caches: dict[str, ConversationCache] = {}  # the hot conversations' caches, by conversation
        # Provenance (ReuseReport.source) of what came into memory since a lease last used it:
        # conversations and shared blocks read from disk or a pool's tier; whatever is not
        # named here stayed in memory since a turn stored it.
        self.read_from: dict[str, CacheSource] = {}
        self.blocks_read: dict[str, CacheSource] = {}
        # Float copies of the most recent conversations' caches, equal to their dequantized
        # blocks: their next turn, and a side request of the same agent starting from them,
        # skip dequantization (``benchmarks/restore.py`` measures it). Their bytes count against
        # the pool's budget as the conversation's private bytes; over budget, the oldest
        # copies go before any conversation's 4-bit cache is spilled.
        self.working: OrderedDict[str, list[KVCache]] = OrderedDict()
        self.working_copies = working_copies
        # Conversations whose client asked to be kept hot only so long (Anthropic
        # cache_control): conversation -> clock time after which it goes warm.
        self.hot_until: dict[str, float] = {}
        self.n_spilled = 0
        self._kv_format = kv_format

    def add_block(self, block: str, data: KVBlock) -> None:
        """Hold a block's data (the first copy read or computed stays) and count it in the pool."""
        self.blocks.setdefault(block, data)
        self.pool.add_block(block, data.nbytes)

    def set_hot(self, cache: ConversationCache) -> None:
        previous = self.caches.get(cache.conversation_id)
        self.caches[cache.conversation_id] = cache
        self.read_from.pop(cache.conversation_id, None)  # what a turn stores is memory's (a load says otherwise)
        self.pool.assign(cache.conversation_id, cache.chain, cache.private_bytes, previous.chain if previous else ())

    def of_agent(self, agent_id: str) -> list[ConversationCache]:
        return [c for c in self.caches.values() if c.agent_id == agent_id]

    def keep_working_copy(self, conversation_id: str, cache: list[KVCache], computed: KVBlock, start: int) -> None:
        """Keep a turn's float cache as its conversation's working copy, made equal to the
        stored blocks from ``start`` on (``computed``); the oldest copies beyond the count go."""
        if self.working_copies <= 0:
            return
        overwrite_with_stored(cache, computed, start, self._kv_format)
        self.working[conversation_id] = cache
        self.working.move_to_end(conversation_id)
        self.pool.set_private(conversation_id, self.caches[conversation_id].private_bytes + cache_nbytes(cache))
        while len(self.working) > self.working_copies:
            self.drop_working_copy(next(iter(self.working)))

    def add_working_copy(self, conversation_id: str, cache: list[KVCache]) -> None:
        """A working copy a hot conversation was given from its stored blocks (as the oldest)."""
        self.working[conversation_id] = cache
        self.working.move_to_end(conversation_id, last=False)
        self.pool.set_private(conversation_id, self.caches[conversation_id].private_bytes + cache_nbytes(cache))

    def drop_working_copy(self, conversation_id: str) -> None:
        del self.working[conversation_id]
        if conversation_id in self.caches:
            self.pool.set_private(conversation_id, self.caches[conversation_id].private_bytes)

    def enforce_budget(self, keep: str) -> None:
        """Back within the pool's budget: unreferenced blocks go, then working copies, then
        the least recently used conversations but ``keep`` are spilled."""
        self.free_arrays(self.pool.evict_free())
        for copy in [c for c in self.working if c != keep]:  # float copies go before 4-bit caches
            if not self.pool.over_budget():
                return
            self.drop_working_copy(copy)
        for victim in self.pool.lru_owners(keep=keep):
            if not self.pool.over_budget():
                return
            self.spill(victim, "pool over budget")
            self.free_arrays(self.pool.evict_free())

    def free_arrays(self, blocks: list[str]) -> None:
        for block in blocks:
            self.blocks.pop(block, None)
            self.blocks_read.pop(block, None)

    def release(self, conversation_id: str) -> None:
        cache = self.caches.pop(conversation_id)
        self.read_from.pop(conversation_id, None)
        self.working.pop(conversation_id, None)
        self.hot_until.pop(conversation_id, None)
        self.pool.remove_owner(conversation_id, cache.chain)

    def spill(self, conversation_id: str, why: str) -> None:
        """Hot -> warm: drop from memory (its files are written or queued)."""
        self.release(conversation_id)
        self.n_spilled += 1
        log.info("conversation %s spilled to disk (%s)", conversation_id, why)

    def expire(self, now: float) -> list[str]:
        """Hot -> warm for conversations unused past their hot TTL at clock time ``now``."""
        due = [conversation for conversation, until in self.hot_until.items() if until <= now]
        for conversation in due:
            del self.hot_until[conversation]
            if conversation in self.caches:
                self.spill(conversation, "its hot TTL passed")
        return due
