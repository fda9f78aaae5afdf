"""CacheManager: the public surface of KV cache reuse, used by the engine thread.

Caches belong to conversations (an agent holds several). ``lease`` finds the
longest reusable prefix for a prompt, by characters: the conversation's own
cache first, else another conversation of the same agent, else the blocks
any conversation stored for the same token prefix (a hybrid model: up to the latest
shared checkpoint of its recurrent state there); in memory first, then on disk.
It returns a float working cache holding that prefix. ``commit`` turns the
working cache after a turn back into 4-bit blocks (only the blocks that
changed) as that conversation's cache, updates the pool and hands a snapshot
to the background persister. Other conversations are never touched.

It holds the model's files (``files.CacheFiles``: format, verification, quarantine) and
its index (``cache_index.CacheIndex``) and opens no database session itself; the MLX
array work is ``blocks.py``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from app.cache.blocks import (BLOCK_TOKENS, KVBlock, cache_nbytes, copy_prefix, join_blocks, overwrite_with_stored,
                              quantize_span, requantize_start, slice_block, to_working_cache)
from app.cache.checkpoints import CacheLayout, Checkpoint, CheckpointPlan, capture, keep, latest_at
from app.cache.formats import DEFAULT_KV_FORMAT, KVFormat
from app.cache.files import (UNUSABLE, CacheFiles, DamagedFile, FileMissing, FileUnavailable, StoredConversation,
                             quarantine_if_damaged)
from app.cache.hashing import block_hash, chain_hashes, private_fingerprint
from app.cache.matcher import PrefixMatch, common_prefix_length, match_prompt
from app.cache.persist import Copy, Forget, Persister, Snapshot
from app.cache.pool import BlockPool, RecentWithin
from app.cache.records import CacheRecord, ConversationCache, fork_cut
from app.clock import utcnow
from app.store.cache_index import CacheEntry, CacheIndex, SharedCheckpoint
from app.types import CacheSource, CacheStats, ForkPoint, Prompt, ReuseReason, ReuseReport

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from sqlalchemy.orm import Session, sessionmaker

    from app.cache.shared_tier import S3Tier

log = logging.getLogger(__name__)

EXCERPT_BEFORE, EXCERPT_AFTER = 30, 50  # characters around a divergence kept for diagnostics


@dataclass(frozen=True)
class Lease:
    """A working cache for one generation and what it already holds."""

    agent_id: str | None
    conversation_id: str | None  # None: nothing will be stored
    cache: list[KVCache]
    record: CacheRecord  # exactly the tokens in ``cache``
    report: ReuseReport  # how reuse ended (its ``reason``) and where the prompt parted
    blocks: tuple[KVBlock, ...] = ()  # the 4-bit data the reused prefix came from
    chain: tuple[str, ...] = ()  # ids of the full blocks among ``blocks``
    # Hybrid models: the recurrent-state checkpoints the turn has (reused) and takes as it
    # prefills (``checkpoints.py``); None for attention-only models.
    plan: CheckpointPlan | None = None
    # In a pool: the agent's ownership epoch when the lease was taken. The turn's cache is
    # stored only while it is still current (a turn begun under an older owner is fenced off).
    epoch: int | None = None
    # The reused prefix is this home's shared data only (nothing, or shared blocks and a
    # shared checkpoint; never a conversation's record, which may be an import's): the
    # checkpoints its prefill takes at block boundaries may be shared (hybrid models).
    public: bool = False
    # The reused prefix came from a conversation holding an import's data (its record's
    # tail or checkpoints, its private blocks: ``ConversationCache.salt``): the blocks the
    # turn fills chain from that import's private fingerprint, never a public id.
    salt: str | None = None

    @property
    def n_reused(self) -> int:
        return self.record.n_tokens


@dataclass(frozen=True)
class _Source:
    """The stored conversation matching a prompt longest, and how far it matched."""

    cache: ConversationCache
    match: PrefixMatch
    common: int  # characters its text and the prompt share


# Hybrid models: shared checkpoints held in memory, the most recently used, take at most
# this share of the pool's budget (``budget_bytes``, beside it) and the latest one used
# always stays; the rest are read from disk, verified, when a lease needs them.
SHARED_CHECKPOINTS_SHARE = 1 / 16

# Conversations used this recently come back into memory after a restart (``prefetch``).
PREFETCH_WINDOW = timedelta(hours=1)


class CacheManager:
    def __init__(self, *, fingerprint: str, n_layers: int, dtype: mx.Dtype, blocks_dir: Path,
                 sessions: sessionmaker[Session], budget_bytes: int, enabled: bool = True,
                 max_conversations: int = 8, working_copies: int = 4, kv_format: KVFormat = DEFAULT_KV_FORMAT,
                 clock: Callable[[], float] = time.monotonic, tier: S3Tier | None = None,
                 owner: str | None = None, layout: CacheLayout | None = None) -> None:
        """``n_layers``: the model's attention layers (those whose KV the blocks hold);
        ``layout``: what each entry of its working cache holds (hybrid models: some keep
        recurrent state, kept as checkpoints; None: attention layers only)."""
        self.fingerprint = fingerprint
        self._layout = layout if layout is not None else CacheLayout.attention_only(n_layers)
        assert self._layout.n_attention == n_layers
        self.kv_format = kv_format
        self.enabled = enabled
        self._n_layers = n_layers
        self._dtype = dtype
        self._index = CacheIndex(sessions, fingerprint)
        self._files = CacheFiles(blocks_dir, fingerprint, tier)
        self._pool = BlockPool(budget_bytes)
        self._blocks: dict[str, KVBlock] = {}
        # Hybrid models: shared checkpoints by the id of the block they follow (``checkpoints.py``).
        self._shared_points: RecentWithin[Checkpoint] = RecentWithin(int(budget_bytes * SHARED_CHECKPOINTS_SHARE))
        self._hot: dict[str, ConversationCache] = {}
        # Provenance (ReuseReport.source) of what came into memory since a lease last used it:
        # conversations (``_load``) and shared blocks (``_load_shared_block``) read from disk or
        # a pool's tier; whatever is not named here stayed in memory since a turn stored it.
        self._read_from: dict[str, CacheSource] = {}
        self._blocks_read: dict[str, CacheSource] = {}
        # Per agent, its conversations with a cache (memory or disk), least recently used
        # first; beyond ``max_conversations`` the oldest one's cache is deleted.
        self._conversations: dict[str, OrderedDict[str, None]] = {}
        self._max_conversations = max_conversations
        # Float copies of the most recent conversations' caches, equal to their dequantized
        # blocks: their next turn, and a side request of the same agent starting from them,
        # skip dequantization (``benchmarks/restore.py`` measures it). Their bytes count against
        # the pool's budget as the conversation's private bytes; over budget, the oldest
        # copies go before any conversation's 4-bit cache is spilled.
        self._working: OrderedDict[str, list[KVCache]] = OrderedDict()
        self._working_copies = working_copies
        self._n_spilled = 0
        # Conversations whose client asked to be kept hot only so long (Anthropic
        # cache_control): conversation -> clock time after which it goes warm.
        self._hot_until: dict[str, float] = {}
        self._clock = clock
        # In a pool with a shared tier: this server's id, and the epoch of each agent it saw
        # when it last served it (app.store.ownership).
        self._owner = owner
        self._epochs: dict[str, int] = {}
        self._persister = Persister(self._files, sessions, owner)
        self._persister.start()
        self._to_prefetch: deque[tuple[str, str]] | None = None  # listed at the first idle moment

    def stats(self) -> CacheStats:
        return CacheStats(self.enabled, self._pool.nbytes, self._pool.budget_bytes, self._pool.n_blocks,
                          self._pool.n_free_blocks, len({c.agent_id for c in self._hot.values()}), len(self._hot),
                          self._n_spilled)

    def record(self, conversation_id: str) -> CacheRecord | None:
        """What the conversation's hot cache holds (None if not hot)."""
        cache = self._hot.get(conversation_id)
        return cache.record if cache else None

    def hot_by_agent(self) -> dict[str, dict[str, int]]:
        """Cached tokens of the conversations in memory, by agent and conversation."""
        hot: dict[str, dict[str, int]] = {}
        for cache in self._hot.values():
            hot.setdefault(cache.agent_id, {})[cache.conversation_id] = cache.record.n_tokens
        return hot

    # -- lease -----------------------------------------------------------------------------

    def lease(self, agent_id: str | None, conversation_id: str | None, prompt: Prompt,
              whole_blocks: bool = False) -> Lease:
        """The longest reusable prefix for ``prompt`` in ``conversation_id`` of ``agent_id``.
        ``whole_blocks`` rounds the reuse down to whole blocks (no private tail)."""
        if not self.enabled or agent_id is None or conversation_id is None:
            return self.cold(None, None, self._report("off"))
        if self._owner is not None and not self._own(agent_id):
            return self.cold(agent_id, conversation_id, self._report("miss"))
        best = self._best_source(agent_id, conversation_id, prompt)
        own = best is not None and best.cache.conversation_id == conversation_id
        n_text = self.kv_format.reusable(best.match.n_reused, best.cache.n_grouped) if best else 0
        n_text -= n_text % BLOCK_TOKENS if whole_blocks else 0
        if best is not None and self._layout.hybrid:
            n_text = self._resumable(best.cache, n_text, whole_blocks)
        shared = self._shared_prefix(prompt) if n_text < prompt.n_tokens - BLOCK_TOKENS else []
        point = None
        if self._layout.hybrid:  # blocks hold no recurrent state: up to the latest shared checkpoint
            shared, point = self._shared_checkpoint(shared, prompt)
        n_shared = self.kv_format.reusable(min(len(shared) * BLOCK_TOKENS, prompt.n_tokens - 1),
                                           len(shared) * BLOCK_TOKENS)
        divergence = self._divergence(best, prompt) if best else {}
        if best is not None and n_text >= n_shared and n_text > 0:
            reason = best.match.reason if own else "sibling"
            source = self._read_from.pop(best.cache.conversation_id, "memory")
            report = self._report(reason, source, n_text, best.cache.record.ends[n_text - 1],
                                  **(divergence if reason not in ("extend", "exact") else {}))
            return self._from_source(best.cache, conversation_id, n_text, report, use_working_copy=own)
        if n_shared > 0:
            reads = {self._blocks_read.pop(block, "memory") for block in shared}
            source = next((s for s in ("tier", "disk") if s in reads), "memory")
            return self._from_shared(agent_id, conversation_id, prompt, shared, n_shared,
                                     self._report("shared", source, n_shared, prompt.ends[n_shared - 1],
                                                  **divergence), point)
        return self.cold(agent_id, conversation_id, self._report("miss", **divergence))

    def _report(self, reason: ReuseReason, source: CacheSource = "none", n_tokens: int = 0, n_chars: int = 0,
                **divergence: Any) -> ReuseReport:
        """How the lease ended, with its provenance: where the ``n_tokens`` reused came from
        and the format they were stored in."""
        return ReuseReport(reason, n_chars, source=source, n_tokens=n_tokens, kv_format=self.kv_format.name,
                           **divergence)

    def _resumable(self, cache: ConversationCache, n_tokens: int, whole_blocks: bool) -> int:
        """Hybrid models: how many of a stored cache's first ``n_tokens`` a lease may reuse:
        up to its latest checkpoint there (where its KV may be cut, and on a whole block if
        asked), else none."""
        point = latest_at(cache.checkpoints, n_tokens, lambda at: self.kv_format.reusable(at, cache.n_grouped) == at
                          and not (whole_blocks and at % BLOCK_TOKENS))
        return point.n_tokens if point is not None else 0

    def _hybrid_lease(self, attention: list[KVCache], n_reused: int,
                      source: ConversationCache | None) -> tuple[list, CheckpointPlan | None]:
        """The working cache of the model's layout, holding ``attention``'s KV and, in a
        hybrid model, the recurrent state of ``source``'s checkpoint at ``n_reused`` tokens
        (its checkpoints up to there travel with the lease)."""
        if not self._layout.hybrid:
            return attention, None
        taken = [p for p in (source.checkpoints if source else ()) if p.n_tokens <= n_reused]
        point = next((p for p in taken if p.n_tokens == n_reused), None)
        assert point is not None or n_reused == 0, "a hybrid lease resumes at a checkpoint"
        return self._layout.assemble(attention, point), CheckpointPlan(self._layout, taken=taken)

    def _own(self, agent_id: str) -> bool:
        """Claim the agent for this server (pool mode). If another server owned it since this
        one last served it, what this one holds in memory may be older than the store: it is
        dropped, and the agent's caches come from the store. False: the store cannot be
        reached (the turn runs cold)."""
        assert self._owner is not None
        try:
            epoch = self._index.claim(agent_id, self._owner, utcnow())
        except Exception as exc:
            log.warning("agent %s: ownership not claimed (%s); no cache this turn", agent_id, exc)
            return False
        if self._epochs.get(agent_id, epoch) != epoch:
            stale = [c.conversation_id for c in self._hot.values() if c.agent_id == agent_id]
            for conversation_id in stale:
                self._release(conversation_id)
            log.info("agent %s: owned by another server since epoch %d; %d conversation(s) dropped from memory",
                     agent_id, self._epochs[agent_id], len(stale))
        self._epochs[agent_id] = epoch
        return True

    def _best_source(self, agent_id: str, conversation_id: str, prompt: Prompt) -> _Source | None:
        """The agent's conversation whose stored text shares the longest prefix with the
        prompt (the request's own conversation on a tie), loaded into memory."""
        best: tuple[int, str] | None = None
        for candidate, text in self._candidates(agent_id, conversation_id):
            common = common_prefix_length(text, prompt.text)
            if best is None or common > best[0]:
                best = (common, candidate)
        if best is None:
            return None
        cache = self._hot.get(best[1]) or self._load(agent_id, best[1])
        if cache is None:
            return None
        return _Source(cache, match_prompt(cache.record, prompt), best[0])

    def _candidates(self, agent_id: str, conversation_id: str) -> Iterator[tuple[str, str]]:
        """(conversation id, stored text) of the request's conversation first, then of the
        agent's others: hot ones from memory, stored ones from their record file's header
        (unverified; a chosen one is verified whole when it loads)."""
        hot = sorted((c for c in self._hot.values() if c.agent_id == agent_id),
                     key=lambda c: c.conversation_id != conversation_id)
        yield from ((c.conversation_id, c.record.text) for c in hot)
        stored = self._index.agent_caches(agent_id)
        stored.sort(key=lambda row: row[0] != conversation_id)
        for other, path in stored[:self._max_conversations + 1]:
            if other in self._hot:
                continue
            try:
                yield other, self._files.read_text(path)
            except (DamagedFile, FileUnavailable):
                continue

    @staticmethod
    def _divergence(source: _Source, prompt: Prompt) -> dict[str, Any]:
        at = source.common
        if at >= len(prompt.text) and at >= len(source.cache.record.text):
            return {}
        return {"offset": at,
                "stored": source.cache.record.text[max(0, at - EXCERPT_BEFORE):at + EXCERPT_AFTER],
                "new": prompt.text[max(0, at - EXCERPT_BEFORE):at + EXCERPT_AFTER]}

    def _from_source(self, source: ConversationCache, conversation_id: str, n_reused: int, report: ReuseReport,
                     use_working_copy: bool) -> Lease:
        self._pool.touch(source.conversation_id)
        n_blocks = -(-n_reused // BLOCK_TOKENS)
        blocks = [self._blocks[h] for h in source.chain[:n_blocks]]
        if len(blocks) < n_blocks:
            assert source.tail is not None
            blocks.append(source.tail)
        working = self._working.get(source.conversation_id)
        if working is not None and working[0].offset != source.record.n_tokens:
            working = None
        if working is not None and use_working_copy:  # the lease owns it until commit
            del self._working[source.conversation_id]
            self._pool.set_private(source.conversation_id, source.private_bytes)
            cache = working
            for layer in cache:
                layer.trim(layer.offset - n_reused)
        elif working is not None:  # another conversation's copy: its first tokens, the copy stays
            self._working.move_to_end(source.conversation_id)
            cache = copy_prefix(working, n_reused)
        else:
            cache = to_working_cache(blocks, self._n_layers, n_reused, self._dtype, self.kv_format)
        cache, plan = self._hybrid_lease(cache, n_reused, source)
        return Lease(source.agent_id, conversation_id, cache, source.record.truncate(n_reused), report,
                     tuple(blocks), source.chain[:min(n_blocks, len(source.chain))], plan,
                     self._epochs.get(source.agent_id), salt=source.salt)

    def cold(self, agent_id: str | None, conversation_id: str | None, report: ReuseReport) -> Lease:
        """An empty working cache whose result is stored as ``conversation_id``'s (if given)."""
        cache, plan = self._hybrid_lease(to_working_cache([], self._n_layers, 0, self._dtype), 0, None)
        epoch = self._epochs.get(agent_id) if agent_id is not None else None
        return Lease(agent_id, conversation_id, cache, CacheRecord.empty(), report, plan=plan, epoch=epoch,
                     public=True)

    def _shared_prefix(self, prompt: Prompt) -> list[str]:
        """The longest chain of the prompt's full blocks held in memory or on disk."""
        if not prompt.ends:
            return []
        usable: list[str] = []
        for block in chain_hashes(self.fingerprint, prompt.token_ids, BLOCK_TOKENS):
            if block not in self._blocks and not self._load_shared_block(block):
                break
            self._pool.touch_block(block)
            usable.append(block)
        return usable

    def _from_shared(self, agent_id: str, conversation_id: str, prompt: Prompt, usable: list[str], n_reused: int,
                     report: ReuseReport, point: Checkpoint | None = None) -> Lease:
        """A lease of the shared blocks ``usable`` (hybrid models: and the shared checkpoint
        ``point`` after them, at ``n_reused``)."""
        blocks = [self._blocks[h] for h in usable]
        cache = to_working_cache(blocks, self._n_layers, n_reused, self._dtype, self.kv_format)
        plan = None
        if self._layout.hybrid:
            assert point is not None and point.n_tokens == n_reused, "a hybrid lease resumes at a checkpoint"
            cache, plan = self._layout.assemble(cache, point), CheckpointPlan(self._layout, taken=[point])
        record = CacheRecord(prompt.token_ids[:n_reused], prompt.text[:prompt.ends[n_reused - 1]],
                             prompt.ends[:n_reused])
        return Lease(agent_id, conversation_id, cache, record, report, tuple(blocks), tuple(usable), plan,
                     epoch=self._epochs.get(agent_id), public=True)

    def _shared_checkpoint(self, shared: list[str], prompt: Prompt) -> tuple[list[str], Checkpoint | None]:
        """Hybrid models: the longest start of ``shared`` (the prompt's blocks found, in
        order) after which a shared checkpoint holds the recurrent state, short of the
        prompt's last token, and that checkpoint; ([], None) if there is none."""
        n = min(len(shared), (prompt.n_tokens - 1) // BLOCK_TOKENS)
        if n == 0:
            return [], None
        stored = None
        for j in range(n, 0, -1):
            block = shared[j - 1]
            point = self._shared_points.get(block)
            if point is None:
                if stored is None:  # one query for all of them, only if memory has none
                    stored = self._index.block_checkpoints(shared[:n])
                point = self._load_shared_checkpoint(stored[block], j * BLOCK_TOKENS) if block in stored else None
            if point is not None and point.n_tokens == j * BLOCK_TOKENS:
                self._keep_shared_checkpoint(block, point)
                return shared[:j], point
        return [], None

    def _load_shared_checkpoint(self, row: SharedCheckpoint, n_tokens: int) -> Checkpoint | None:
        """A shared checkpoint from disk, verified against its index row (a damaged file is
        quarantined); None if it cannot be used: a miss, never a wrong state."""
        try:
            arrays, dtypes = self._files.read_shared_checkpoint(row.block, row.path, row.checksum, n_tokens)
            point = Checkpoint.from_numpy(n_tokens, arrays, "", dtypes)
            if len(point.states) != self._layout.n_recurrent:
                raise ValueError("it does not hold every recurrent layer's state")
        except (FileMissing, FileUnavailable) as exc:
            log.warning("shared checkpoint after block %s unavailable: %s", row.block, exc)
            return None
        except UNUSABLE as exc:
            log.warning("shared checkpoint after block %s unusable: %s", row.block, exc)
            quarantine_if_damaged(self._files.local(row.path, fetch=False), self._files.root, row.checksum)
            return None
        return point

    def _keep_shared_checkpoint(self, block: str, point: Checkpoint) -> None:
        """Hold a shared checkpoint in memory, the most recently used (within
        ``SHARED_CHECKPOINTS_SHARE`` of the budget)."""
        self._shared_points.keep(block, point)

    def _load_shared_block(self, block: str) -> bool:
        """Bring a block some conversation stored on disk into memory (free), if it verifies."""
        found = self._index.block_file(block)
        if found is None or found[1] is None:  # a row without a checksum vouches for no file
            return False
        try:
            data = KVBlock.from_numpy(self._files.read_block(block, found[0], found[1]), self._n_layers, BLOCK_TOKENS)
        except (*UNUSABLE, FileUnavailable) as exc:
            log.warning("shared block %s unusable: %s", block, exc)
            return False
        self._blocks[block] = data
        self._pool.add_block(block, data.nbytes)
        self._blocks_read[block] = "tier" if self._files.take_fetched([found[0]]) else "disk"
        return True

    # -- commit ----------------------------------------------------------------------------

    def commit(self, lease: Lease, record: CacheRecord, cache: list[KVCache], persist: bool = True,
               hot_ttl_s: float | None = None) -> threading.Event | None:
        """Store the cache after a turn as the lease's conversation's: ``record`` describes
        exactly what ``cache`` holds. Without ``persist`` it stays in memory only (gone on
        restart or eviction); with ``hot_ttl_s`` it goes warm once unused that long.

        Returns:
            With ``persist``, an event set once the cache is on disk (written in the
            background); else None.
        """
        if not self.enabled or lease.agent_id is None or lease.conversation_id is None:
            return None
        conversation_id = lease.conversation_id
        if self._owner is not None and lease.epoch != self._epochs.get(lease.agent_id):
            log.info("conversation %s: not stored, its turn began under ownership epoch %s of agent %s, now %s",
                     conversation_id, lease.epoch, lease.agent_id, self._epochs.get(lease.agent_id))
            return None
        checkpoints = self._checkpoints(lease, cache, record.n_tokens)
        cache = self._layout.attention(cache)
        if cache[0].offset != record.n_tokens:
            log.error("conversation %s: cache holds %d tokens but its record %d; not stored",
                      conversation_id, cache[0].offset, record.n_tokens)
            return None
        begin = requantize_start(list(lease.blocks), lease.n_reused, self.kv_format)
        kept = min(begin // BLOCK_TOKENS, len(lease.chain))
        chain: list[str] = list(lease.chain[:kept])
        start = kept * BLOCK_TOKENS
        pending = [slice_block(join_blocks(list(lease.blocks[kept:])), 0, begin - start)] if begin > start else []
        computed = quantize_span(cache, begin, record.n_tokens, self.kv_format)
        pending.append(computed)
        fresh = join_blocks(pending)
        # An import's data (and what the turn computed on top of it) stays its conversation's:
        # the ids of the blocks it fills chain from the import's private fingerprint.
        addressed = private_fingerprint(self.fingerprint, lease.salt) if lease.salt is not None else self.fingerprint
        for offset in range(0, fresh.n_grouped - BLOCK_TOKENS + 1, BLOCK_TOKENS):  # full blocks hold no float16 keys
            parent = chain[-1] if chain else None
            at = start + offset
            block = block_hash(addressed, parent, record.tokens[at:at + BLOCK_TOKENS])
            if block not in self._blocks:
                self._blocks[block] = slice_block(fresh, offset, offset + BLOCK_TOKENS)
                self._pool.add_block(block, self._blocks[block].nbytes)
            chain.append(str(block))
        full = len(chain) * BLOCK_TOKENS
        tail = slice_block(fresh, full - start, fresh.n_tokens) if record.n_tokens > full else None
        stored = ConversationCache(lease.agent_id, conversation_id, record, tuple(chain), tail, checkpoints,
                                   lease.salt)
        shared = self._shareable(lease, chain)
        for block_id, point in shared.items():
            self._keep_shared_checkpoint(block_id, point)
        self._set_hot(stored)
        self._keep_working_copy(conversation_id, cache, computed, begin)
        written = self._persister.submit(Snapshot(stored, {h: self._blocks[h] for h in stored.chain},
                                                  lease.epoch, shared)) if persist else None
        if hot_ttl_s is not None and persist:
            self._hot_until[conversation_id] = self._clock() + hot_ttl_s
        else:
            self._hot_until.pop(conversation_id, None)
        self._remember(lease.agent_id, conversation_id)
        self._enforce_budget(keep=conversation_id)
        return written

    def _checkpoints(self, lease: Lease, cache: list, n_tokens: int) -> tuple[Checkpoint, ...]:
        """Hybrid models: the checkpoints a conversation keeps after a turn whose cache holds
        ``n_tokens``: those its lease had and its prefill took, and one of the cache as it
        is now (the reply's end), within ``checkpoints.MAX_CHECKPOINTS``."""
        if lease.plan is None:
            return ()
        taken = [p for p in lease.plan.taken if p.n_tokens < n_tokens]
        return keep([*taken, capture(self._layout, cache, n_tokens)])

    @staticmethod
    def _shareable(lease: Lease, chain: list[str]) -> dict[str, Checkpoint]:
        """Hybrid models: the checkpoints a turn's prefill took at block boundaries, by the
        id of the block ending there, if the turn began from this home's shared data only
        (``Lease.public``): each holds for every prompt starting with that block's tokens."""
        if lease.plan is None or not lease.public:
            return {}
        return {chain[p.n_tokens // BLOCK_TOKENS - 1]: p for p in lease.plan.taken
                if p.n_tokens > lease.n_reused and p.n_tokens % BLOCK_TOKENS == 0
                and p.n_tokens // BLOCK_TOKENS <= len(chain)}

    def _remember(self, agent_id: str, conversation_id: str) -> None:
        """Mark the conversation the agent's most recent; delete the cache of its least
        recently used conversation beyond ``max_conversations`` (only that one)."""
        order = self._conversations.get(agent_id)
        if order is None:
            stored = self._index.agent_caches(agent_id)
            order = self._conversations[agent_id] = OrderedDict((c, None) for c, _ in reversed(stored))
        order[conversation_id] = None
        order.move_to_end(conversation_id)
        while len(order) > self._max_conversations:
            victim, _ = order.popitem(last=False)
            self._drop(victim)
            log.info("agent %s: conversation %s's cache deleted (beyond %d conversations)", agent_id, victim,
                     self._max_conversations)

    def _drop(self, conversation_id: str) -> None:
        """Delete one conversation's cache: memory now, files and rows in write order."""
        if conversation_id in self._hot:
            self._release(conversation_id)
        self._persister.submit(Forget(conversation_id))

    # -- tiers -----------------------------------------------------------------------------

    def expire_hot(self) -> list[str]:
        """Hot -> warm for conversations unused past their hot TTL (their files are written or queued)."""
        now = self._clock()
        due = [conversation for conversation, until in self._hot_until.items() if until <= now]
        for conversation in due:
            del self._hot_until[conversation]
            if conversation in self._hot:
                self._spill(conversation, "its hot TTL passed")
        return due

    def forget_agent(self, agent_id: str) -> Callable[[float | None], bool]:
        """Delete every conversation cache of this agent: memory, files, rows (blocks other
        conversations still reference stay: they are theirs too). The files and rows go on the
        writer thread: returns the wait for them (``flush``), to call off the engine thread,
        which this must never hold while a disk works."""
        stored = {c for c, _ in self._index.agent_caches(agent_id)}
        known = set(self._conversations.pop(agent_id, {}))
        hot = {c.conversation_id for c in self._hot.values() if c.agent_id == agent_id}
        for conversation_id in stored | known | hot:
            self._drop(conversation_id)
        log.info("agent %s: %d conversation caches deleted", agent_id, len(stored | known | hot))
        return self._persister.flush

    def fork(self, source: str, agent_id: str, conversation_id: str,
             point: ForkPoint | None = None) -> threading.Event:
        """Give a forked agent's conversation a copy of the ``source`` conversation's cache,
        up to ``point`` (None: all of it). Queued after the source's own writes; the event
        is set once the copy is stored. A copy up to a point holds the record's tokens
        before it and their KV only: the full blocks before it, shared, and a private tail
        cut from the block the point falls in."""
        if point is None:
            return self._persister.submit(Copy(source, agent_id, conversation_id))
        cache = self._hot.get(source) if self.enabled else None
        if cache is None and self.enabled and (source_agent := self._index.agent_of(source)) is not None:
            cache = self._load(source_agent, source)
        n_kept = 0
        if cache is not None:
            n_kept = self.kv_format.reusable(cache.record.n_tokens_within(fork_cut(cache.record.text, point)),
                                             cache.n_grouped)
        if cache is None or n_kept == 0:
            done = threading.Event()
            done.set()
            return done
        n_full = n_kept // BLOCK_TOKENS
        tail = None
        if n_kept > n_full * BLOCK_TOKENS:
            cut = self._blocks[cache.chain[n_full]] if n_full < len(cache.chain) else cache.tail
            assert cut is not None
            tail = slice_block(cut, 0, n_kept - n_full * BLOCK_TOKENS)
        copy = ConversationCache(agent_id, conversation_id, cache.record.truncate(n_kept), cache.chain[:n_full], tail,
                                 tuple(p for p in cache.checkpoints if p.n_tokens <= n_kept), cache.salt)
        log.info("agent %s: forked with %d of conversation %s's %d cached tokens", agent_id, n_kept, source,
                 cache.record.n_tokens)
        return self._persister.submit(Snapshot(copy, {h: self._blocks[h] for h in copy.chain}))

    # -- after a start -----------------------------------------------------------------------

    def prefetch(self) -> bool:
        """Bring one recently used conversation back from disk, with its float working copy.

        After a restart, the conversations used in the last ``PREFETCH_WINDOW`` (the most
        recent first, as many as there are working copies) come back into memory while
        the engine is idle, so their next turns start as if the server had never stopped.
        Stops at the first one that does not fit the pool's budget beside what is hot.
        Returns whether it loaded one (False once none is due).
        """
        if self._to_prefetch is None:
            due = []
            if self.enabled and self._working_copies > 0:
                due = self._index.recent(utcnow() - PREFETCH_WINDOW, self._working_copies)
            self._to_prefetch = deque(due)
        while self._to_prefetch:
            agent_id, conversation_id = self._to_prefetch.popleft()
            if conversation_id in self._hot or not self._still_mine(agent_id):
                continue
            if not self._fits_beside_hot(conversation_id):  # never loaded only to be spilled
                log.info("conversation %s: no room to prefetch it beside what is in memory; it loads when asked",
                         conversation_id)
                self._to_prefetch.clear()
                return False
            cache = self._load(agent_id, conversation_id)
            if cache is None:
                continue
            blocks = [self._blocks[h] for h in cache.chain] + ([cache.tail] if cache.tail is not None else [])
            working = to_working_cache(blocks, self._n_layers, cache.record.n_tokens, self._dtype, self.kv_format)
            self._working[conversation_id] = working
            self._working.move_to_end(conversation_id, last=False)  # loaded most recent first
            self._pool.set_private(conversation_id, cache.private_bytes + cache_nbytes(working))
            if self._pool.over_budget():
                self._spill(conversation_id, "no room to prefetch it")
                self._free_arrays(self._pool.evict_free())
                self._to_prefetch.clear()
                return False
            log.info("conversation %s: prefetched with its working copy", conversation_id)
            return True
        return False

    def _fits_beside_hot(self, conversation_id: str) -> bool:
        """Whether the conversation's stored blocks and its float working copy (estimated from
        the stored bytes: as many values, in the working dtype) fit the pool's budget beside
        what is in memory now."""
        entry = self._index.load(conversation_id)
        if entry is None:
            return True  # nothing to load: _load says so
        try:  # the record file holds the private tail's KV
            tail = self._files.local(entry.record_path, fetch=False).stat().st_size
        except OSError:  # not on this disk (a pool's tier has it): as many bytes a token as the blocks
            tail = (entry.n_tokens - len(entry.blocks) * BLOCK_TOKENS) * (
                entry.blocks[0].nbytes // BLOCK_TOKENS if entry.blocks else 0)
        stored = sum(block.nbytes for block in entry.blocks) + tail
        working = int(stored / self.kv_format.bytes_per_value * self._dtype.size)
        return self._pool.nbytes + stored + working <= self._pool.budget_bytes

    def _still_mine(self, agent_id: str) -> bool:
        """Outside a pool, True. In a pool: whether this server still owns the agent (a server
        prefetches only its own agents, and remembers the epoch it saw, as serving does)."""
        if self._owner is None:
            return True
        owner = self._index.owner(agent_id)
        if owner is None or owner[0] != self._owner:
            return False
        self._epochs[agent_id] = owner[1]
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for background writes (tests, shutdown)."""
        return self._persister.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued (to disk and the shared tier)."""
        self._persister.flush(30)
        self._persister.stop()

    def release_agents(self) -> None:
        """In a pool, as the server stops (after ``close``): give up the agents it owns."""
        if self._owner is not None:
            try:
                released = self._index.release_all(self._owner, utcnow())
                log.info("released %d agent(s) to the pool", released)
            except Exception as exc:  # the store is down: the next server's claim takes them anyway
                log.warning("agents not released (%s)", exc)

    def _set_hot(self, cache: ConversationCache) -> None:
        previous = self._hot.get(cache.conversation_id)
        self._hot[cache.conversation_id] = cache
        self._read_from.pop(cache.conversation_id, None)  # what a turn stores is memory's (``_load`` says otherwise)
        self._pool.assign(cache.conversation_id, cache.chain, cache.private_bytes, previous.chain if previous else ())

    def _keep_working_copy(self, conversation_id: str, cache: list[KVCache], computed: KVBlock, start: int) -> None:
        if self._working_copies <= 0:
            return
        overwrite_with_stored(cache, computed, start, self.kv_format)
        self._working[conversation_id] = cache
        self._working.move_to_end(conversation_id)
        self._pool.set_private(conversation_id, self._hot[conversation_id].private_bytes + cache_nbytes(cache))
        while len(self._working) > self._working_copies:
            self._drop_working_copy(next(iter(self._working)))

    def _drop_working_copy(self, conversation_id: str) -> None:
        del self._working[conversation_id]
        if conversation_id in self._hot:
            self._pool.set_private(conversation_id, self._hot[conversation_id].private_bytes)

    def _enforce_budget(self, keep: str) -> None:
        self._free_arrays(self._pool.evict_free())
        for copy in [c for c in self._working if c != keep]:  # float copies go before 4-bit caches
            if not self._pool.over_budget():
                return
            self._drop_working_copy(copy)
        for victim in self._pool.lru_owners(keep=keep):
            if not self._pool.over_budget():
                return
            self._spill(victim, "pool over budget")
            self._free_arrays(self._pool.evict_free())

    def _free_arrays(self, blocks: list[str]) -> None:
        for block in blocks:
            self._blocks.pop(block, None)
            self._blocks_read.pop(block, None)

    def _release(self, conversation_id: str) -> None:
        cache = self._hot.pop(conversation_id)
        self._read_from.pop(conversation_id, None)
        self._working.pop(conversation_id, None)
        self._hot_until.pop(conversation_id, None)
        self._pool.remove_owner(conversation_id, cache.chain)

    def _spill(self, conversation_id: str, why: str) -> None:
        """Hot -> warm: drop from memory (its files are written or queued)."""
        self._release(conversation_id)
        self._n_spilled += 1
        log.info("conversation %s spilled to disk (%s)", conversation_id, why)

    def _load(self, agent_id: str, conversation_id: str) -> ConversationCache | None:
        """Warm -> hot. A damaged or missing file makes the whole cache a miss."""
        entry = self._index.load(conversation_id)
        if entry is None:
            return None
        try:
            cache, loaded = self._decode(agent_id, conversation_id, self._files.read_conversation(entry, self._blocks))
        except Exception as exc:  # whatever went wrong reading it, the cache is not used now
            # Unreadable just now, or (in a pool) a file the shared tier did not deliver, down or
            # having lost the object: nothing says it is damaged, so the row and the writer's
            # files stay. Anything else is damage: the cache is discarded.
            if isinstance(exc, FileUnavailable) or (isinstance(exc, FileMissing) and self._files.tier is not None):
                log.warning("conversation %s: cache unavailable just now (%s); a miss", conversation_id, exc)
            else:
                log.warning("conversation %s: cache on disk unusable (%s); treating as a miss", conversation_id, exc)
                self._discard(conversation_id, entry)
            return None
        for block, data in loaded.items():
            self._blocks.setdefault(block, data)
            self._pool.add_block(block, data.nbytes)
        self._set_hot(cache)
        fetched = self._files.take_fetched([entry.record_path, *(block.path for block in entry.blocks)])
        self._read_from[conversation_id] = "tier" if fetched else "disk"
        log.info("conversation %s: loaded %d cached tokens from disk", conversation_id, cache.record.n_tokens)
        return cache

    def _decode(self, agent_id: str, conversation_id: str,
                stored: StoredConversation) -> tuple[ConversationCache, dict[str, KVBlock]]:
        """A conversation's cache and the blocks read for it, as arrays of this model's
        layers. Raises KeyError or ValueError if the arrays are not its blocks'."""
        blocks = {block: KVBlock.from_numpy(arrays, self._n_layers, BLOCK_TOKENS)
                  for block, arrays in stored.blocks.items()}
        tail = KVBlock.from_numpy(stored.tail, self._n_layers, stored.tail_tokens) if stored.tail is not None else None
        checkpoints = tuple(Checkpoint.from_numpy(at, arrays, "", dtypes) for at, arrays, dtypes in stored.checkpoints)
        if any(len(p.states) != self._layout.n_recurrent for p in checkpoints):
            raise ValueError("a checkpoint does not hold every recurrent layer's state")
        return ConversationCache(agent_id, conversation_id, stored.record, stored.chain, tail, checkpoints,
                                 stored.salt), blocks

    def _discard(self, conversation_id: str, entry: CacheEntry) -> None:
        """Quarantine the damaged files of an unusable cache and forget the cache."""
        self._files.quarantine_damaged(entry)
        self._persister.submit(Forget(conversation_id))
