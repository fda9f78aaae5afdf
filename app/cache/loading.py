"""Warm -> hot: a conversation's stored cache read back into memory, verified whole
(``load``: when a lease needs it), and after a start the recently used ones brought back
with their float working copies while the engine is idle (``prefetch``).

A damaged file makes the whole cache a miss and is quarantined, the cache forgotten; a
file unreadable just now (or one a pool's shared tier did not deliver) is a miss only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from app.cache.blocks import BLOCK_TOKENS, KVBlock, finish, to_working_cache_steps
from app.cache.checkpoints import CacheLayout, Checkpoint
from app.cache.files import Arrays, CacheFiles, FileMissing, FileUnavailable, StoredConversation, verify_all
from app.cache.formats import KVFormat
from app.cache.hot_set import HotSet
from app.cache.ownership import Ownership
from app.cache.persist import Forget, Persister
from app.cache.records import ConversationCache
from app.clock import utcnow
from app.errors import out_of_memory
from app.store.cache_index import CacheEntry, CacheIndex

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

log = logging.getLogger(__name__)

# Conversations used this recently come back into memory after a restart (``prefetch``).
PREFETCH_WINDOW = timedelta(hours=1)
# Layers of a prefetched working copy built in one step: two, one on each of the CPU's
# working streams (``blocks.working_streams``); a request waits for one step at most.
PREFETCH_LAYERS = 2
# While a prefetch's files are read, the engine looks for requests this often.
PREFETCH_POLL_S = 0.005

# The reader thread's niceness above the engine's (Linux): a prefetch is for a turn that may
# come, a request's prefill for one that is here, and on a small machine they share the cores.
PREFETCH_NICENESS = 10

# A prefetch's steps: each yields the work under way (a Future: its files' reads, then their
# checks) or None; it returns the conversation put in memory and its working copy, or None.
Prefetching = Generator["Future[Any] | None", None, "tuple[ConversationCache, list[KVCache]] | None"]


class Loader:
    def __init__(self, *, layout: CacheLayout, dtype: mx.Dtype, kv_format: KVFormat, index: CacheIndex,
                 files: CacheFiles, memory: HotSet, persister: Persister, ownership: Ownership) -> None:
        self._layout = layout
        self._dtype = dtype
        self._kv_format = kv_format
        self._index = index
        self._files = files
        self._memory = memory  # where what is read goes
        self._persister = persister  # forgets a damaged cache, in write order
        self._ownership = ownership
        self._to_prefetch: deque[tuple[str, str]] | None = None  # listed at the first idle moment
        # The conversation being prefetched and its remaining steps (``prefetch``), its files
        # read on a thread of their own (reading and hashing release the GIL).
        self._in_flight: tuple[str, Prefetching] | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cache-prefetch", initializer=_below_requests)
        # Reads and checks a lease waits for, beside the engine's dequantizing (``_restoring``).
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="cache-restore")

    def load(self, agent_id: str, conversation_id: str, with_working_copy: bool = False) -> ConversationCache | None:
        """Warm -> hot. A damaged or missing file makes the whole cache a miss. A conversation
        being prefetched is not read again: the prefetch finishes first.

        ``with_working_copy`` (a lease of the conversation's own next turn): its float working
        copy is built as it comes back, from the blocks as read while their checksums are
        checked (``_restoring``), and kept as the conversation's, which the lease takes.
        Otherwise its blocks are verified as they are read and the caller builds what it needs."""
        self.finish_prefetch(conversation_id)
        if conversation_id in self._memory.caches:
            return self._memory.caches[conversation_id]
        entry = self._index.load(conversation_id)
        if entry is None:
            return None
        if with_working_copy and self._layout.n_attention > 0:
            restored = finish(self._restoring(agent_id, conversation_id, entry, background=False),
                              lambda step: step is not None and wait([step]))
            if restored is None:
                return None
            self._keep(conversation_id, *restored, within_budget=False)
            return restored[0]
        return self._take(agent_id, conversation_id, entry,
                          lambda: self._files.read_conversation(entry, self._block, self._memory.blocks))

    def _block(self, arrays: Arrays) -> KVBlock:
        """A full block's arrays as read (``CacheFiles.read_block``: on the reading thread),
        copied into MLX arrays of this model's layers. Raises KeyError or ValueError if they
        are not such a block's."""
        return KVBlock.from_numpy(arrays, self._layout.n_attention, BLOCK_TOKENS)

    def _take(self, agent_id: str, conversation_id: str, entry: CacheEntry,
              read: Callable[[], StoredConversation[KVBlock]]) -> ConversationCache | None:
        """The conversation ``read`` gives, put in memory (hot), or None: a miss."""
        try:
            stored = read()
            cache = self._decode(agent_id, conversation_id, stored)
        except Exception as exc:  # whatever went wrong reading it, the cache is not used now
            self._miss(conversation_id, entry, exc)
            return None
        return self._put(conversation_id, entry, cache, stored.blocks)

    def _miss(self, conversation_id: str, entry: CacheEntry, exc: Exception) -> None:
        """A conversation could not be read back (``exc``): a miss. Unreadable just now, (in
        a pool) a file the shared tier did not deliver, down or having lost the object, or no
        memory to hold it: nothing says it is damaged, so the row and the writer's files stay.
        Anything else is damage: the cache is discarded."""
        if isinstance(exc, FileUnavailable) or (isinstance(exc, FileMissing) and self._files.tier is not None):
            log.warning("conversation %s: cache unavailable just now (%s); a miss", conversation_id, exc)
        elif out_of_memory(exc):  # the files are not at fault: the cache stays for a later turn
            log.warning("conversation %s: no memory to read its cache back just now (%s); a miss, the cache kept",
                        conversation_id, exc)
        else:
            log.warning("conversation %s: cache on disk unusable (%s); treating as a miss", conversation_id, exc)
            self._discard(conversation_id, entry)

    def _put(self, conversation_id: str, entry: CacheEntry, cache: ConversationCache,
             loaded: dict[str, KVBlock]) -> ConversationCache:
        """A conversation read back and verified, and the blocks read for it, put in memory (hot)."""
        for block, data in loaded.items():
            self._memory.add_block(block, data)
        self._memory.set_hot(cache)
        fetched = self._files.take_fetched([entry.record_path, *(block.path for block in entry.blocks)])
        self._memory.read_from[conversation_id] = "tier" if fetched else "disk"
        log.info("conversation %s: loaded %d cached tokens from disk", conversation_id, cache.record.n_tokens)
        return cache

    def prefetch(self) -> bool:
        """One step of bringing a recently used conversation back from disk, with its float
        working copy; returns whether it did one (False once none is due).

        After a restart, the conversations used in the last ``PREFETCH_WINDOW`` (the most
        recent first, as many as there are working copies; in a pool, this server's agents'
        only) come back into memory while the engine is idle, so their next turns start as if
        the server had never stopped. Stops at the first one that does not fit the pool's
        budget beside what is hot.

        A conversation comes back in steps: its files read and verified on a thread of their
        own (this returns every ``PREFETCH_POLL_S`` meanwhile), then put in memory (hot from
        then on), then its working copy a few layers at a time (``PREFETCH_LAYERS``). The
        engine calls this only while idle and runs requests between steps, so a request waits
        for one step, not for a whole conversation it did not ask for; a request that uses the
        conversation in flight takes its result (``finish_prefetch``).
        """
        if self._in_flight is None:
            self._in_flight = self._next_due()
            if self._in_flight is None:
                return False
        conversation_id, steps = self._in_flight
        try:
            step = next(steps)
        except StopIteration as done:
            self._in_flight = None
            if done.value is not None:
                cache, working = done.value
                self._keep(conversation_id, cache, working, within_budget=True)
            return True
        if step is not None:  # its files are being read: a short wait, then the engine looks for requests
            wait([step], PREFETCH_POLL_S)
        return True

    def finish_prefetch(self, conversation_id: str) -> None:
        """A lease is about to use ``conversation_id``: if it is the one being prefetched, its
        remaining steps run now and the lease takes the working copy (nothing is read twice)."""
        if self._in_flight is None or self._in_flight[0] != conversation_id:
            return
        steps = self._in_flight[1]
        self._in_flight = None
        result = finish(steps, lambda step: step is not None and wait([step]))
        if result is not None:  # the lease's commit keeps the pool within budget
            cache, working = result
            self._keep(conversation_id, cache, working, within_budget=False)

    def close(self) -> None:
        """Stop the prefetch's reader (a read under way finishes on its own)."""
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._checker.shutdown(wait=False, cancel_futures=True)

    def _next_due(self) -> tuple[str, Prefetching] | None:
        """The next conversation to prefetch and its steps, or None (none is due, or the next
        does not fit: then none is prefetched after it)."""
        if self._to_prefetch is None:
            due = []
            if self._memory.working_copies > 0:
                due = self._index.recent(utcnow() - PREFETCH_WINDOW, self._memory.working_copies)
            self._to_prefetch = deque(due)
        while self._to_prefetch:
            agent_id, conversation_id = self._to_prefetch.popleft()
            if conversation_id in self._memory.caches or not self._ownership.still_mine(agent_id):
                continue
            if not self._fits_beside_hot(conversation_id):  # never loaded only to be spilled
                log.info("conversation %s: no room to prefetch it beside what is in memory; it loads when asked",
                         conversation_id)
                self._to_prefetch.clear()
                return None
            return conversation_id, self._prefetching(agent_id, conversation_id)
        return None

    def _prefetching(self, agent_id: str, conversation_id: str) -> Prefetching:
        """A prefetch's steps: ``_restoring`` with its reads and checks on the reader thread."""
        entry = self._index.load(conversation_id)
        if entry is None:
            return None
        return (yield from self._restoring(agent_id, conversation_id, entry, background=True))

    def _restoring(self, agent_id: str, conversation_id: str, entry: CacheEntry,
                   background: bool) -> Prefetching:
        """Read a conversation's files, its block files' checksums left to check
        (``CacheFiles.read_conversation_unverified``); build its working copy from the blocks
        as read while their checksums are checked beside it, on other threads; then, every one
        verified, put it in memory (hot from then on) and return it with its working copy.

        Hashing the blocks runs while the dequantizing waits on memory, which made the restore
        shorter than with the checks on the reading threads (docs/benchmarks.md, "Measured
        choices in the code"). Nothing read is where a request can see
        it before it is verified: a block that fails its checksum drops the working copy built
        from it (or the error building it, if its data did not fit), and the cache is a miss,
        its damaged files quarantined.

        ``background`` (a prefetch): the reads and the checks run on the reader thread (below
        requests), and each step yields the one under way, the working copy built
        ``PREFETCH_LAYERS`` at a time, so that the engine runs requests between steps. Every
        block file is read, even those in memory now: the engine may let one go meanwhile.
        Otherwise (a lease waiting for it), blocks in memory are not read again, the working
        copy is built in one step, and the steps yield nothing for anyone to wait on but the
        checks (``finish`` runs them all)."""
        run = self._reader if background else self._checker
        skip = () if background else self._memory.blocks
        reading = run.submit(self._files.read_conversation_unverified, entry, self._block, skip)
        while not reading.done():
            yield reading
        try:
            stored = reading.result()
            cache = self._decode(agent_id, conversation_id, stored)
        except Exception as exc:  # a damaged record file, or a block file unreadable or not this model's
            self._miss(conversation_id, entry, exc)
            return None
        read = list(stored.blocks.values())
        checking = run.submit(verify_all, read)
        blocks = [stored.blocks[h].data if h in stored.blocks else self._memory.blocks[h] for h in cache.chain]
        blocks += [cache.tail] if cache.tail is not None else []
        working: list[KVCache] = []
        unbuilt: Exception | None = None  # unverified data may not fit together: the checks say whether it is damage
        try:
            working = yield from to_working_cache_steps(blocks, self._layout.n_attention, cache.record.n_tokens,
                                                        self._dtype, self._kv_format,
                                                        PREFETCH_LAYERS if background else self._layout.n_attention)
        except Exception as exc:
            unbuilt = exc
        while not checking.done():
            yield checking
        try:
            verified = dict(zip(stored.blocks, checking.result()))
        except Exception as exc:  # a block's data is not what its file claims: damaged
            self._miss(conversation_id, entry, exc)
            return None
        if unbuilt is not None and out_of_memory(unbuilt):
            self._miss(conversation_id, entry, unbuilt)  # a miss; the cache stays for a later turn
            return None
        if unbuilt is not None:
            raise unbuilt  # what was read is what was written: not the files' fault
        if conversation_id in self._memory.caches:  # a turn stored it meanwhile: memory's is the newer
            log.info("conversation %s: stored by a turn while it was read back; what was read is dropped",
                     conversation_id)
            return None
        return self._put(conversation_id, entry, cache, verified), working

    def _keep(self, conversation_id: str, cache: ConversationCache, working: list[KVCache],
              within_budget: bool) -> None:
        """Give a prefetched conversation its working copy, unless it changed between the steps
        (spilled, or dropped from memory): then the copy is not its blocks' any more."""
        if self._memory.caches.get(conversation_id) is not cache or conversation_id in self._memory.working:
            log.info("conversation %s: left memory while it was prefetched; its working copy is dropped",
                     conversation_id)
            return
        self._memory.add_working_copy(conversation_id, working)  # loaded most recent first
        if within_budget and self._memory.pool.over_budget():
            self._memory.spill(conversation_id, "no room to prefetch it")
            self._memory.free_arrays(self._memory.pool.evict_free())
            assert self._to_prefetch is not None
            self._to_prefetch.clear()
            return
        log.info("conversation %s: %s with its working copy", conversation_id,
                 "prefetched" if within_budget else "read back")

    def _fits_beside_hot(self, conversation_id: str) -> bool:
        """Whether the conversation's stored blocks and its float working copy (estimated from
        the stored bytes: as many values, in the working dtype) fit the pool's budget beside
        what is in memory now."""
        entry = self._index.load(conversation_id)
        if entry is None:
            return True  # nothing to load: load says so
        try:  # the record file holds the private tail's KV
            tail = self._files.local(entry.record_path, fetch=False).stat().st_size
        except OSError:  # not on this disk (a pool's tier has it): as many bytes a token as the blocks
            tail = (entry.n_tokens - len(entry.blocks) * BLOCK_TOKENS) * (
                entry.blocks[0].nbytes // BLOCK_TOKENS if entry.blocks else 0)
        stored = sum(block.nbytes for block in entry.blocks) + tail
        working = int(stored / self._kv_format.bytes_per_value * self._dtype.size)
        pool = self._memory.pool
        return pool.nbytes + stored + working <= pool.budget_bytes

    def _decode(self, agent_id: str, conversation_id: str, stored: StoredConversation[Any]) -> ConversationCache:
        """A conversation's cache as read (its blocks made on the reading threads: ``_block``),
        its tail as arrays of this model's layers. Raises KeyError or ValueError if the arrays
        are not its tail's."""
        n_layers = self._layout.n_attention
        tail = KVBlock.from_numpy(stored.tail, n_layers, stored.tail_tokens) if stored.tail is not None else None
        checkpoints = tuple(Checkpoint.from_numpy(at, arrays, "", dtypes) for at, arrays, dtypes in stored.checkpoints)
        if any(len(p.states) != self._layout.n_recurrent for p in checkpoints):
            raise ValueError("a checkpoint does not hold every recurrent layer's state")
        return ConversationCache(agent_id, conversation_id, stored.record, stored.chain, tail, checkpoints,
                                 stored.salt)

    def _discard(self, conversation_id: str, entry: CacheEntry) -> None:
        """Quarantine the damaged files of an unusable cache and forget the cache."""
        self._files.quarantine_damaged(entry)
        self._persister.submit(Forget(conversation_id))


def _below_requests() -> None:
    """Lower the calling thread's priority by ``PREFETCH_NICENESS`` (Linux, where niceness is a
    thread's own; elsewhere it is the whole process's, which is left as it is). Threads it
    starts (``files.CacheFiles``' block readers) inherit it."""
    if sys.platform == "linux":
        os.nice(PREFETCH_NICENESS)
