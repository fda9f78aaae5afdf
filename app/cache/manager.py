"""CacheManager: the public surface of KV cache reuse, used by the engine thread.

``lease`` finds an agent's cache (in memory, else on disk), matches the new
prompt against its record by characters and returns a float working cache
holding the reusable prefix. ``commit`` turns the working cache after a turn
back into 4-bit blocks (only the blocks that changed), updates the pool and
hands a snapshot to the background persister.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from sqlalchemy.orm import Session, sessionmaker

from app.cache.blocks import (BLOCK_TOKENS, KVBlock, join_blocks, overwrite_with_stored, quantize_span,
                              slice_block, to_working_cache)
from app.cache.hashing import block_hash, chain_hashes
from app.cache.matcher import Outcome, match_prompt
from app.cache.persist import CacheFiles, Persister, Snapshot
from app.cache.pool import BlockPool
from app.cache.records import CacheRecord
from app.store import blockfiles, cache_index
from app.store.models import Block
from app.types import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentCache:
    record: CacheRecord
    chain: tuple[str, ...]
    tail: KVBlock | None

    @property
    def private_bytes(self) -> int:
        return self.tail.nbytes if self.tail else 0


@dataclass(frozen=True)
class Lease:
    """A working cache for one generation and what it already holds."""

    cache: list[KVCache]
    record: CacheRecord  # exactly the tokens in ``cache``
    outcome: Outcome
    blocks: tuple[KVBlock, ...] = ()  # the 4-bit data the reused prefix came from
    chain: tuple[str, ...] = ()  # ids of the full blocks among ``blocks``

    @property
    def n_reused(self) -> int:
        return self.record.n_tokens


@dataclass(frozen=True, slots=True)
class CacheStats:
    enabled: bool
    pool_bytes: int
    budget_bytes: int
    n_blocks: int
    hot_agents: int
    n_spilled: int


class CacheManager:
    def __init__(self, *, fingerprint: str, n_layers: int, dtype: mx.Dtype, blocks_dir: Path,
                 sessions: sessionmaker[Session], budget_bytes: int, enabled: bool = True,
                 working_copies: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = fingerprint
        self.enabled = enabled
        self._n_layers = n_layers
        self._dtype = dtype
        self._sessions = sessions
        self._files = CacheFiles(blocks_dir, fingerprint)
        self._pool = BlockPool(budget_bytes)
        self._blocks: dict[str, KVBlock] = {}
        self._agents: dict[str, AgentCache] = {}
        # Float copies of the most recent agents' caches, equal to their dequantized
        # blocks: their next turn skips dequantization (about 0.2 s per 1K tokens on CPU).
        # Their bytes count against the pool's budget as the agent's private bytes.
        self._working: OrderedDict[str, list[KVCache]] = OrderedDict()
        self._working_copies = working_copies
        self._n_spilled = 0
        # Agents whose client asked to be kept hot only so long (Anthropic cache_control):
        # agent -> clock time after which it goes warm.
        self._hot_until: dict[str, float] = {}
        self._clock = clock
        self._persister = Persister(self._files, sessions)
        self._persister.start()

    def stats(self) -> CacheStats:
        return CacheStats(self.enabled, self._pool.nbytes, self._pool.budget_bytes, self._pool.n_blocks,
                          len(self._agents), self._n_spilled)

    def record(self, agent_id: str) -> CacheRecord | None:
        """What the agent's hot cache holds (None if not hot)."""
        agent = self._agents.get(agent_id)
        return agent.record if agent else None

    def lease(self, agent_id: str | None, prompt: Prompt, whole_blocks: bool = False) -> Lease:
        """The longest reusable prefix for ``prompt``: the agent's own cache by
        characters, else (a new agent) the longest chain of shared blocks.
        ``whole_blocks`` rounds the reuse down to whole blocks (no private tail)."""
        if not self.enabled or agent_id is None:
            return self._cold()
        agent = self._agents.get(agent_id) or self._load(agent_id)
        if agent is None:
            return self._shared(prompt)
        self._pool.touch(agent_id)
        match = match_prompt(agent.record, prompt.text)
        n_reused = match.n_reused - match.n_reused % BLOCK_TOKENS if whole_blocks else match.n_reused
        if n_reused == 0:
            return self._cold(match.outcome)
        n_blocks = -(-n_reused // BLOCK_TOKENS)
        blocks = [self._blocks[h] for h in agent.chain[:n_blocks]]
        if len(blocks) < n_blocks:
            assert agent.tail is not None
            blocks.append(agent.tail)
        cache = self._working.pop(agent_id, None)  # the lease owns it until commit
        self._pool.set_private(agent_id, agent.private_bytes)
        if cache is not None and cache[0].offset == agent.record.n_tokens:
            for layer in cache:
                layer.trim(layer.offset - n_reused)
        else:
            cache = to_working_cache(blocks, self._n_layers, n_reused, self._dtype)
        return Lease(cache, agent.record.truncate(n_reused), match.outcome, tuple(blocks), agent.chain[:n_blocks])

    def _cold(self, outcome: Outcome = "miss") -> Lease:
        return Lease(to_working_cache([], self._n_layers, 0, self._dtype), CacheRecord.empty(), outcome)

    def _shared(self, prompt: Prompt) -> Lease:
        """Start a new agent from blocks other agents hold for the same prefix."""
        if not prompt.ends:
            return self._cold()
        usable = []
        for block in chain_hashes(self.fingerprint, prompt.token_ids, BLOCK_TOKENS):
            if block not in self._blocks and not self._load_shared_block(block):
                break
            usable.append(block)
        n_reused = min(len(usable) * BLOCK_TOKENS, prompt.n_tokens - 1)
        if n_reused <= 0:
            return self._cold()
        blocks = [self._blocks[h] for h in usable]
        cache = to_working_cache(blocks, self._n_layers, n_reused, self._dtype)
        record = CacheRecord(prompt.token_ids[:n_reused], prompt.text[:prompt.ends[n_reused - 1]],
                             prompt.ends[:n_reused])
        return Lease(cache, record, "shared", tuple(blocks), tuple(usable))

    def _load_shared_block(self, block: str) -> bool:
        """Bring a block another agent stored on disk into memory, if it verifies."""
        with self._sessions() as session:
            row = session.get(Block, block)
            path, digest = (row.path, row.checksum) if row is not None and row.path else (None, None)
        if path is None:
            return False
        try:
            arrays, meta = blockfiles.read(Path(path), digest or None)
            if meta.get("fingerprint") != self.fingerprint:
                return False
            data = KVBlock.from_arrays(_to_mx(arrays), self._n_layers, BLOCK_TOKENS)
        except (blockfiles.DamagedFile, KeyError, ValueError) as exc:
            log.warning("shared block %s unusable: %s", block, exc)
            return False
        self._blocks[block] = data
        self._pool.add_block(block, data.nbytes)
        return True

    def commit(self, agent_id: str | None, lease: Lease, record: CacheRecord, cache: list[KVCache],
               persist: bool = True, hot_ttl_s: float | None = None) -> None:
        """Store the cache after a turn: ``record`` describes exactly what ``cache`` holds.
        Without ``persist`` it stays in memory only (gone on restart or eviction);
        with ``hot_ttl_s`` it goes warm once unused that long (``expire_hot``)."""
        if not self.enabled or agent_id is None:
            return
        if cache[0].offset != record.n_tokens:
            log.error("agent %s: cache holds %d tokens but its record %d; not stored",
                      agent_id, cache[0].offset, record.n_tokens)
            return
        previous = self._agents.get(agent_id)
        kept = lease.n_reused // BLOCK_TOKENS
        chain = list(lease.chain[:kept])
        # Reused tokens keep their 4-bit data as is (quantizing dequantized values
        # again would add error every turn); only tokens computed now are quantized.
        start = kept * BLOCK_TOKENS
        pending = [slice_block(join_blocks(list(lease.blocks[kept:])), 0, lease.n_reused - start)] \
            if lease.n_reused > start else []
        computed = quantize_span(cache, lease.n_reused, record.n_tokens)
        pending.append(computed)
        fresh = join_blocks(pending)
        for offset in range(0, fresh.n_tokens - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            parent = chain[-1] if chain else None
            at = start + offset
            block = block_hash(self.fingerprint, parent, record.tokens[at:at + BLOCK_TOKENS])
            if block not in self._blocks:
                self._blocks[block] = slice_block(fresh, offset, offset + BLOCK_TOKENS)
                self._pool.add_block(block, self._blocks[block].nbytes)
            chain.append(block)
        full = len(chain) * BLOCK_TOKENS
        tail = slice_block(fresh, full - start, fresh.n_tokens) if record.n_tokens > full else None
        agent = AgentCache(record, tuple(chain), tail)
        self._set_hot(agent_id, agent, previous)
        self._keep_working_copy(agent_id, cache, computed, lease.n_reused)
        if persist:
            self._persister.submit(Snapshot(agent_id, record, agent.chain, tail,
                                            {h: self._blocks[h] for h in agent.chain}))
        if hot_ttl_s is not None and persist:
            self._hot_until[agent_id] = self._clock() + hot_ttl_s
        else:
            self._hot_until.pop(agent_id, None)
        self._enforce_budget(keep=agent_id)

    def expire_hot(self) -> list[str]:
        """Hot -> warm for agents unused past their hot TTL (their files are written or queued)."""
        now = self._clock()
        due = [agent for agent, until in self._hot_until.items() if until <= now]
        for agent in due:
            del self._hot_until[agent]
            if agent in self._agents:
                self._spill(agent, "its hot TTL passed")
        return due

    def forget(self, agent_id: str) -> None:
        """Delete everything of this agent's cache: memory, its files, its rows.

        Blocks other agents still reference stay (they are theirs too).
        """
        if agent_id in self._agents:
            self._spill(agent_id, "the agent was deleted")
            self._n_spilled -= 1  # a deletion, not an eviction
        self._persister.flush(60)  # no queued write may bring the cache back
        with self._sessions.begin() as session:
            entry = cache_index.load_cache(session, agent_id, self.fingerprint)
            orphans = cache_index.drop_cache(session, agent_id, self.fingerprint)
        if entry is not None:
            Path(entry.record_path).unlink(missing_ok=True)
        for path in orphans:
            Path(path).unlink(missing_ok=True)
        log.info("agent %s: cache deleted (%d block files removed)", agent_id, len(orphans))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for background writes (tests, shutdown)."""
        return self._persister.flush(timeout_s)

    def close(self) -> None:
        self._persister.flush(30)
        self._persister.stop()

    def _set_hot(self, agent_id: str, agent: AgentCache, previous: AgentCache | None) -> None:
        self._agents[agent_id] = agent
        freed = self._pool.assign(agent_id, agent.chain, agent.private_bytes, previous.chain if previous else ())
        for block in freed:
            self._blocks.pop(block, None)

    def _keep_working_copy(self, agent_id: str, cache: list[KVCache], computed: KVBlock, start: int) -> None:
        if self._working_copies <= 0:
            return
        overwrite_with_stored(cache, computed, start)
        self._working[agent_id] = cache
        self._pool.set_private(agent_id, self._agents[agent_id].private_bytes + _nbytes(cache))
        while len(self._working) > self._working_copies:
            dropped, _ = self._working.popitem(last=False)
            if dropped in self._agents:
                self._pool.set_private(dropped, self._agents[dropped].private_bytes)

    def _enforce_budget(self, keep: str) -> None:
        for victim in self._pool.lru_agents(keep=keep):
            if not self._pool.over_budget():
                return
            self._spill(victim, "pool over budget")

    def _spill(self, agent_id: str, why: str) -> None:
        """Hot -> warm: drop from memory (its files are written or queued)."""
        agent = self._agents.pop(agent_id)
        self._n_spilled += 1
        self._working.pop(agent_id, None)
        self._hot_until.pop(agent_id, None)
        for block in self._pool.remove_agent(agent_id, agent.chain):
            self._blocks.pop(block, None)
        log.info("agent %s spilled to disk (%s)", agent_id, why)

    def _load(self, agent_id: str) -> AgentCache | None:
        """Warm -> hot. A damaged or missing file makes the whole cache a miss."""
        with self._sessions() as session:
            entry = cache_index.load_cache(session, agent_id, self.fingerprint)
        if entry is None:
            return None
        try:
            agent, loaded = self._read_files(entry)
        except (blockfiles.DamagedFile, KeyError, ValueError) as exc:
            log.warning("agent %s: cache on disk unusable (%s); treating as a miss", agent_id, exc)
            self._discard(agent_id)
            return None
        for block, data in loaded.items():
            self._blocks.setdefault(block, data)
            self._pool.add_block(block, data.nbytes)
        self._set_hot(agent_id, agent, None)
        log.info("agent %s: loaded %d cached tokens from disk", agent_id, agent.record.n_tokens)
        return agent

    def _read_files(self, entry: cache_index.CacheEntry) -> tuple[AgentCache, dict[str, KVBlock]]:
        arrays, meta = blockfiles.read(Path(entry.record_path))
        record = CacheRecord(tuple(int(t) for t in arrays["tokens"]), meta["text"],
                             tuple(int(e) for e in arrays["ends"]))
        chain = tuple(json.loads(meta["chain"]))
        if chain != tuple(b.hash for b in entry.blocks):
            raise ValueError("record file and index disagree on the block chain")
        loaded: dict[str, KVBlock] = {}
        for row in entry.blocks:
            if row.hash in self._blocks:
                continue
            block_arrays, block_meta = blockfiles.read(Path(row.path), row.checksum or None)
            if block_meta.get("fingerprint") != self.fingerprint or block_meta.get("hash") != row.hash:
                raise ValueError(f"block file {row.path} belongs to another model or block")
            loaded[row.hash] = KVBlock.from_arrays(_to_mx(block_arrays), self._n_layers, BLOCK_TOKENS)
        tail_tokens = int(meta["tail_tokens"])
        tail = None
        if tail_tokens:
            tail_arrays = {k.removeprefix("tail."): v for k, v in arrays.items() if k.startswith("tail.")}
            tail = KVBlock.from_arrays(_to_mx(tail_arrays), self._n_layers, tail_tokens)
        if len(chain) * BLOCK_TOKENS + tail_tokens != record.n_tokens:
            raise ValueError("blocks do not cover the record")
        return AgentCache(record, chain, tail), loaded

    def _discard(self, agent_id: str) -> None:
        with self._sessions.begin() as session:
            entry = cache_index.load_cache(session, agent_id, self.fingerprint)
            orphans = cache_index.drop_cache(session, agent_id, self.fingerprint)
        if entry is None:
            return
        for path in [Path(entry.record_path), *(Path(b.path) for b in entry.blocks)]:
            try:
                blockfiles.read(path)
            except blockfiles.DamagedFile:
                blockfiles.quarantine(path, self._files.root)
        for path in orphans:  # intact blocks nobody references any more
            Path(path).unlink(missing_ok=True)


def _nbytes(cache: list[KVCache]) -> int:
    """Memory a float working cache holds (its allocated buffers)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache if layer.keys is not None)


def _to_mx(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {name: mx.array(array) for name, array in arrays.items()}
