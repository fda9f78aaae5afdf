"""The shared prefix of a prompt: the blocks any conversation stored for its first tokens and,
in a hybrid model, the shared checkpoint of the recurrent state after the last of them.

Blocks are addressed by content (``hashing.chain_hashes``), so whichever conversation stored
one, it holds for every prompt that starts with the same tokens; a shared checkpoint is
taken by a turn that began from this home's shared data only (``shareable``). Both are found
in memory first, then on disk (or a pool's tier), verified as they load: a damaged or missing
file is a miss, never a wrong state.
"""

from __future__ import annotations

import logging

from app.cache.blocks import BLOCK_TOKENS, KVBlock
from app.cache.checkpoints import CacheLayout, Checkpoint, CheckpointPlan
from app.cache.files import UNUSABLE, CacheFiles, FileMissing, FileUnavailable, quarantine_if_damaged
from app.cache.hashing import chain_hashes
from app.cache.hot_set import HotSet
from app.cache.pool import RecentWithin
from app.errors import out_of_memory
from app.store.cache_index import CacheIndex, SharedCheckpoint
from app.types import CacheSource, Prompt

log = logging.getLogger(__name__)

# Hybrid models: shared checkpoints held in memory, the most recently used, take at most
# this share of the pool's budget (``budget_bytes``, beside it) and the latest one used
# always stays; the rest are read from disk, verified, when a lease needs them.
SHARED_CHECKPOINTS_SHARE = 1 / 16


class SharedPrefix:
    def __init__(self, fingerprint: str, layout: CacheLayout, index: CacheIndex, files: CacheFiles,
                 memory: HotSet) -> None:
        self._fingerprint = fingerprint
        self._layout = layout
        self._index = index
        self._files = files
        self._memory = memory  # where the blocks read go
        # Hybrid models: shared checkpoints by the id of the block they follow (``checkpoints.py``).
        self._points: RecentWithin[Checkpoint] = RecentWithin(int(memory.pool.budget_bytes * SHARED_CHECKPOINTS_SHARE))

    def find(self, prompt: Prompt) -> tuple[list[str], Checkpoint | None]:
        """The ids of the longest chain of the prompt's full blocks held in memory or on disk
        (now in memory); in a hybrid model, only up to the latest shared checkpoint short of
        the prompt's last token, and that checkpoint (else ([], None))."""
        shared = self._blocks(prompt)
        if not self._layout.hybrid:
            return shared, None
        return self._checkpoint(shared, prompt)  # blocks hold no recurrent state: up to a checkpoint

    def source(self, blocks: list[str]) -> CacheSource:
        """Where the blocks a lease reuses came from (the farthest of them), as it takes them."""
        reads = {self._memory.blocks_read.pop(block, "memory") for block in blocks}
        return next((s for s in ("tier", "disk") if s in reads), "memory")

    def keep(self, block: str, point: Checkpoint) -> None:
        """Hold a shared checkpoint in memory, the most recently used (within
        ``SHARED_CHECKPOINTS_SHARE`` of the budget)."""
        self._points.keep(block, point)

    def _blocks(self, prompt: Prompt) -> list[str]:
        if not prompt.ends:
            return []
        usable: list[str] = []
        for block in chain_hashes(self._fingerprint, prompt.token_ids, BLOCK_TOKENS):
            if block not in self._memory.blocks and not self._load_block(block):
                break
            self._memory.pool.touch_block(block)
            usable.append(block)
        return usable

    def _checkpoint(self, shared: list[str], prompt: Prompt) -> tuple[list[str], Checkpoint | None]:
        """Hybrid models: the longest start of ``shared`` (the prompt's blocks found, in
        order) after which a shared checkpoint holds the recurrent state, short of the
        prompt's last token, and that checkpoint; ([], None) if there is none."""
        n = min(len(shared), (prompt.n_tokens - 1) // BLOCK_TOKENS)
        if n == 0:
            return [], None
        stored = None
        for j in range(n, 0, -1):
            block = shared[j - 1]
            point = self._points.get(block)
            if point is None:
                if stored is None:  # one query for all of them, only if memory has none
                    stored = self._index.block_checkpoints(shared[:n])
                point = self._load_checkpoint(stored[block], j * BLOCK_TOKENS) if block in stored else None
            if point is not None and point.n_tokens == j * BLOCK_TOKENS:
                self.keep(block, point)
                return shared[:j], point
        return [], None

    def _load_checkpoint(self, row: SharedCheckpoint, n_tokens: int) -> Checkpoint | None:
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

    def _load_block(self, block: str) -> bool:
        """Bring a block some conversation stored on disk into memory (free), if it verifies."""
        found = self._index.block_file(block)
        if found is None or found[1] is None:  # a row without a checksum vouches for no file
            return False
        try:
            data = self._files.read_block(block, found[0], found[1],
                                          lambda arrays: KVBlock.from_numpy(arrays, self._layout.n_attention,
                                                                            BLOCK_TOKENS))
        except (*UNUSABLE, FileUnavailable) as exc:
            log.warning("shared block %s unusable: %s", block, exc)
            return False
        except (MemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            log.warning("shared block %s: no memory to read it just now (%s)", block, exc)
            return False
        self._memory.add_block(block, data)
        self._memory.blocks_read[block] = "tier" if self._files.take_fetched([found[0]]) else "disk"
        return True


def shareable(plan: CheckpointPlan | None, n_reused: int, chain: list[str]) -> dict[str, Checkpoint]:
    """Hybrid models: the checkpoints a turn's prefill took (``plan``: None for a turn that did
    not begin from this home's shared data only, ``Lease.public``) at block boundaries past
    its ``n_reused`` tokens, by the id of the block ending there (``chain``: the turn's
    blocks): each holds for every prompt starting with that block's tokens."""
    if plan is None:
        return {}
    return {chain[p.n_tokens // BLOCK_TOKENS - 1]: p for p in plan.taken
            if p.n_tokens > n_reused and p.n_tokens % BLOCK_TOKENS == 0 and p.n_tokens // BLOCK_TOKENS <= len(chain)}
