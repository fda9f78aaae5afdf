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
array work is ``blocks.py``'s. What it holds in memory is ``hot_set.HotSet``'s, a prompt's
shared blocks and checkpoints are found by ``shared_prefix.SharedPrefix``, stored caches are
read back by ``loading.Loader``, and in a pool ``ownership.Ownership`` says which agents
are this server's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cache.blocks import (
    BLOCK_TOKENS,
    KVBlock,
    copy_prefix,
    join_blocks,
    quantize_span,
    requantize_start,
    slice_block,
    to_working_cache,
)
from app.cache.checkpoints import CacheLayout, Checkpoint, CheckpointPlan, latest_at, resume
from app.cache.files import CacheFiles, DamagedFile, FileUnavailable
from app.cache.formats import DEFAULT_KV_FORMAT, KVFormat
from app.cache.hashing import block_hash, private_fingerprint
from app.cache.hot_set import HotSet
from app.cache.loading import Loader
from app.cache.matcher import PrefixMatch, common_prefix_length, match_prompt
from app.cache.ownership import Ownership
from app.cache.persist import FLUSH_ON_CLOSE_S, STOP_ON_CLOSE_S, Copy, Forget, Persister, Snapshot
from app.cache.records import CacheRecord, ConversationCache, fork_cut
from app.cache.shared_prefix import SharedPrefix, shareable
from app.store.cache_index import CacheIndex
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
        self._memory = HotSet(budget_bytes, working_copies, kv_format)
        # The hot set's pool and containers, read here at every step.
        self._pool, self._blocks, self._hot, self._working = (self._memory.pool, self._memory.blocks,
                                                              self._memory.caches, self._memory.working)
        self._shared = SharedPrefix(fingerprint, self._layout, self._index, self._files, self._memory)
        # Per agent, its conversations with a cache (memory or disk), least recently used
        # first; beyond ``max_conversations`` the oldest one's cache is deleted.
        self._conversations: dict[str, OrderedDict[str, None]] = {}
        self._max_conversations = max_conversations
        self._clock = clock
        self._ownership = Ownership(self._index, owner)  # in a pool: which agents are this server's
        self._persister = Persister(self._files, sessions, owner)
        self._persister.start()
        self._loader = Loader(layout=self._layout, dtype=dtype, kv_format=kv_format, index=self._index,
                              files=self._files, memory=self._memory, persister=self._persister,
                              ownership=self._ownership)

    def stats(self) -> CacheStats:
        return CacheStats(self.enabled, self._pool.nbytes, self._pool.budget_bytes, self._pool.n_blocks,
                          self._pool.n_free_blocks, len({c.agent_id for c in self._hot.values()}), len(self._hot),
                          self._memory.n_spilled)

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
        claim = self._ownership.claim(agent_id)
        if claim == "unreachable":
            return self.cold(agent_id, conversation_id, self._report("miss"))
        if claim == "moved":
            self._drop_from_memory(agent_id)
        best = self._best_source(agent_id, conversation_id, prompt)
        own = best is not None and best.cache.conversation_id == conversation_id
        n_text = self.kv_format.reusable(best.match.n_reused, best.cache.n_grouped) if best else 0
        n_text -= n_text % BLOCK_TOKENS if whole_blocks else 0
        if best is not None and self._layout.hybrid:
            n_text = self._resumable(best.cache, n_text, whole_blocks)
        shared, point = ([], None) if n_text >= prompt.n_tokens - BLOCK_TOKENS else self._shared.find(prompt)
        n_shared = self.kv_format.reusable(min(len(shared) * BLOCK_TOKENS, prompt.n_tokens - 1),
                                           len(shared) * BLOCK_TOKENS)
        divergence = self._divergence(best, prompt) if best else {}
        if best is not None and n_text >= n_shared and n_text > 0:
            reason = best.match.reason if own else "sibling"
            source = self._memory.read_from.pop(best.cache.conversation_id, "memory")
            report = self._report(reason, source, n_text, best.cache.record.ends[n_text - 1],
                                  **(divergence if reason not in ("extend", "exact") else {}))
            return self._from_source(best.cache, conversation_id, n_text, report, use_working_copy=own)
        if n_shared > 0:
            report = self._report("shared", self._shared.source(shared), n_shared, prompt.ends[n_shared - 1],
                                  **divergence)
            return self._from_shared(agent_id, conversation_id, prompt, shared, n_shared, report, point)
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

    def _drop_from_memory(self, agent_id: str) -> None:
        """Release the agent's hot conversations: another server owned the agent since this one
        last served it, so they may be older than the store (its caches load from there)."""
        stale = [c.conversation_id for c in self._memory.of_agent(agent_id)]
        for conversation_id in stale:
            self._memory.release(conversation_id)
        log.info("agent %s: %d conversation(s) dropped from memory", agent_id, len(stale))

    def _best_source(self, agent_id: str, conversation_id: str, prompt: Prompt) -> _Source | None:
        """The agent's conversation whose stored text shares the longest prefix with the
        prompt (the request's own conversation on a tie), loaded into memory."""
        best: tuple[int, str, bool] | None = None
        for candidate, text in self._candidates(agent_id, conversation_id):
            common = common_prefix_length(text, prompt.text)
            if best is None or common > best[0]:
                best = (common, candidate, common == len(text))
        if best is None:
            return None
        # The request's own conversation, continued, comes back with its whole working copy,
        # which its lease takes; a stored text the prompt leaves is dequantized up to the cut.
        whole = best[1] == conversation_id and best[2]
        cache = self._hot.get(best[1]) or self._loader.load(agent_id, best[1], with_working_copy=whole)
        if cache is None:
            return None
        return _Source(cache, match_prompt(cache.record, prompt), best[0])

    def _candidates(self, agent_id: str, conversation_id: str) -> Iterator[tuple[str, str]]:
        """(conversation id, stored text) of the request's conversation first, then of the
        agent's others: hot ones from memory, stored ones from their record file's header
        (unverified; a chosen one is verified whole when it loads)."""
        hot = sorted(self._memory.of_agent(agent_id),
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
        self._loader.finish_prefetch(source.conversation_id)  # its working copy, if being prefetched
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
        cache, plan = resume(self._layout, cache, n_reused, source.checkpoints)
        return Lease(source.agent_id, conversation_id, cache, source.record.truncate(n_reused), report,
                     tuple(blocks), source.chain[:min(n_blocks, len(source.chain))], plan,
                     self._ownership.epoch(source.agent_id), salt=source.salt)

    def cold(self, agent_id: str | None, conversation_id: str | None, report: ReuseReport) -> Lease:
        """An empty working cache whose result is stored as ``conversation_id``'s (if given)."""
        cache, plan = resume(self._layout, to_working_cache([], self._n_layers, 0, self._dtype), 0, ())
        return Lease(agent_id, conversation_id, cache, CacheRecord.empty(), report, plan=plan,
                     epoch=self._ownership.epoch(agent_id), public=True)

    def _from_shared(self, agent_id: str, conversation_id: str, prompt: Prompt, usable: list[str], n_reused: int,
                     report: ReuseReport, point: Checkpoint | None = None) -> Lease:
        """A lease of the shared blocks ``usable`` (hybrid models: and the shared checkpoint
        ``point`` after them, at ``n_reused``)."""
        blocks = [self._blocks[h] for h in usable]
        cache, plan = resume(self._layout, to_working_cache(blocks, self._n_layers, n_reused, self._dtype,
                                                            self.kv_format), n_reused, [point] if point else [])
        record = CacheRecord(prompt.token_ids[:n_reused], prompt.text[:prompt.ends[n_reused - 1]],
                             prompt.ends[:n_reused])
        return Lease(agent_id, conversation_id, cache, record, report, tuple(blocks), tuple(usable), plan,
                     epoch=self._ownership.epoch(agent_id), public=True)

    # -- commit ----------------------------------------------------------------------------

    def commit(self, lease: Lease, record: CacheRecord, cache: list[KVCache], persist: bool = True,
               hot_ttl_s: float | None = None) -> threading.Event | None:
        """Store the cache after a turn as the lease's conversation's: ``record`` describes
        exactly what ``cache`` holds. Without ``persist`` it stays in memory only (gone on
        restart or eviction); with ``hot_ttl_s`` it goes warm once unused that long. The
        cache becomes the conversation's working copy (made equal to the stored blocks).

        Returns:
            With ``persist``, an event set once the cache is on disk (written in the
            background); else None.
        """
        return self._store(lease, record, cache, persist, hot_ttl_s, working_copy=True)

    def checkpoint(self, lease: Lease, record: CacheRecord, cache: list[KVCache]) -> threading.Event | None:
        """Store what a prefill still under way has computed (``record``: the first tokens of
        the turn's, ``cache`` holding exactly them), in memory and on disk, as a commit would,
        but leave ``cache`` untouched (the prefill goes on in it, in floats): a process killed
        before the turn ends keeps these blocks. The turn's own commit supersedes it."""
        return self._store(lease, record, cache, True, None, working_copy=False)

    def _store(self, lease: Lease, record: CacheRecord, cache: list[KVCache], persist: bool,
               hot_ttl_s: float | None, working_copy: bool) -> threading.Event | None:
        if not self.enabled or lease.agent_id is None or lease.conversation_id is None:
            return None
        conversation_id = lease.conversation_id
        if not self._ownership.current(lease.agent_id, lease.epoch):
            log.info("conversation %s: not stored, its turn began under ownership epoch %s of agent %s, now %s",
                     conversation_id, lease.epoch, lease.agent_id, self._ownership.epoch(lease.agent_id))
            return None
        checkpoints = lease.plan.kept(cache, record.n_tokens) if lease.plan is not None else ()
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
                self._memory.add_block(block, slice_block(fresh, offset, offset + BLOCK_TOKENS))
            chain.append(str(block))
        full = len(chain) * BLOCK_TOKENS
        tail = slice_block(fresh, full - start, fresh.n_tokens) if record.n_tokens > full else None
        stored = ConversationCache(lease.agent_id, conversation_id, record, tuple(chain), tail, checkpoints,
                                   lease.salt)
        shared = shareable(lease.plan if lease.public else None, lease.n_reused, chain)
        for block_id, point in shared.items():
            self._shared.keep(block_id, point)
        self._memory.set_hot(stored)
        if working_copy:
            self._memory.keep_working_copy(conversation_id, cache, computed, begin)
        written = self._persister.submit(Snapshot(stored, {h: self._blocks[h] for h in stored.chain},
                                                  lease.epoch, shared)) if persist else None
        if hot_ttl_s is not None and persist:
            self._memory.hot_until[conversation_id] = self._clock() + hot_ttl_s
        else:
            self._memory.hot_until.pop(conversation_id, None)
        self._remember(lease.agent_id, conversation_id)
        self._memory.enforce_budget(keep=conversation_id)
        return written

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
            self._memory.release(conversation_id)
        self._persister.submit(Forget(conversation_id))

    # -- tiers -----------------------------------------------------------------------------

    def expire_hot(self) -> list[str]:
        """Hot -> warm for conversations unused past their hot TTL (their files are written or queued)."""
        return self._memory.expire(self._clock())

    def forget_agent(self, agent_id: str) -> Callable[[float | None], bool]:
        """Delete every conversation cache of this agent: memory, files, rows (blocks other
        conversations still reference stay: they are theirs too). The files and rows go on the
        writer thread: returns the wait for them (``flush``), to call off the engine thread,
        which this must never hold while a disk works."""
        stored = {c for c, _ in self._index.agent_caches(agent_id)}
        known = set(self._conversations.pop(agent_id, {}))
        hot = {c.conversation_id for c in self._memory.of_agent(agent_id)}
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
            cache = self._loader.load(source_agent, source)
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
        """One step of bringing the recently used conversations back from disk while the engine
        is idle after a start (``loading.Loader.prefetch``); False once none is due."""
        return self.enabled and self._loader.prefetch()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for background writes (tests, shutdown)."""
        return self._persister.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued (to disk and the shared tier)."""
        self._loader.close()
        self._persister.flush(FLUSH_ON_CLOSE_S)
        self._persister.stop(STOP_ON_CLOSE_S)

    def release_agents(self) -> None:
        """In a pool, as the server stops (after ``close``): give up the agents it owns."""
        self._ownership.release_all()
