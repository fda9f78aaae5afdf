"""A batch KV cache whose rows can each drop a different number of a step's last tokens (MLX).

mlx-lm's ``BatchKVCache`` keeps every row's tokens in one buffer, left-padded so that all
rows end at the same index, and its ``trim`` cuts the same number of tokens from every
row. Speculating sequences decoding together (``speculation.Lanes``) feed a draft each in
one forward pass and each keeps as much of its draft as was accepted: one row may drop
none of the step's tokens and the next all of them. Moving each row's tokens to line them
up again would copy the whole cache every step; instead the tokens a row drops beyond the
fewest any row drops stay where they are, as *holes*: the attention mask hides them, the
row's ``offset`` (the position its next token is rotated to) no longer counts them, and
``extract`` leaves them out. A hole's keys are never read, so a row attends to exactly the
tokens it kept, at the positions they had: what a cache cut back on its own holds. A
sliding window counts kept tokens only, as the row's own cache would.

Holes cost memory and masked attention work until the rows are extracted and merged
again (``compacted``), which ``Lanes`` does when they pass a share of the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class RaggedBatchKVCache(BatchKVCache):
    """A ``BatchKVCache`` with per-row ``trim_rows``: holes masked until compaction."""

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        self._holes: mx.array | None = None  # (rows, positions) True where a row dropped a token; up to _idx

    @property
    def n_holes(self) -> int:
        """The most holes any row has."""
        if self._holes is None:
            return 0
        most: int = self._holes.sum(axis=1).max().item()  # type: ignore[assignment]  # an int count
        return most

    def trim_rows(self, counts: Sequence[int]) -> None:
        """Drop the last ``counts[i]`` tokens of row ``i`` (each at most what the last
        ``update_and_fetch`` added)."""
        common = min(counts)
        if common:
            self.trim(common)
        extra = [count - common for count in counts]
        if not any(extra):
            return
        positions = mx.arange(self._idx)[None]
        dropped = positions >= (self._idx - mx.array(extra))[:, None]
        self._holes = dropped if self._holes is None else self._padded_holes(self._idx) | dropped
        self.offset = self.offset - mx.array(extra)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self._holes is not None:
            self._holes = self._holes[:, :self._idx]
        return n

    def _padded_holes(self, length: int) -> mx.array:
        """The holes over the first ``length`` positions (positions past them are none)."""
        assert self._holes is not None
        have = self._holes.shape[1]
        if have >= length:
            return self._holes[:, :length]
        return mx.concatenate([self._holes, mx.zeros((self._holes.shape[0], length - have), dtype=mx.bool_)],
                              axis=1)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: object) -> mx.array:
        """The causal mask of the next ``N`` positions, without the holes. A sliding window
        (``window_size``: Gemma 3's and GPT-OSS's local layers) spans the last ``window_size``
        tokens a row kept, not buffer positions: holes inside it do not count."""
        if self._holes is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        holes = self._padded_holes(self._idx + N)
        mask = super().make_mask(N, return_array=return_array, **kwargs) & ~holes[:, None, None, :]
        if window_size is None:
            return mask
        rank = mx.cumsum((~holes).astype(mx.int32), axis=1)  # kept tokens up to each position
        distance = rank[:, -N:, None] - rank[:, None, :]  # (rows, N, positions): kept tokens between
        return mask & (distance < window_size)[:, None]

    def extract(self, idx: int) -> KVCache:
        cache = super().extract(idx)
        if self._holes is None:
            return cache
        padding: int = self.left_padding[idx].item()  # type: ignore[assignment]  # an int
        row: list[bool] = self._padded_holes(self._idx)[idx, padding:].tolist()  # type: ignore[assignment]
        kept = mx.array([i for i, hole in enumerate(row) if not hole])
        if kept.size == cache.keys.shape[2]:
            return cache
        cache.keys = mx.contiguous(mx.take(cache.keys, kept, axis=2))
        cache.values = mx.contiguous(mx.take(cache.values, kept, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache

    def filter(self, batch_indices: Sequence[int]) -> None:
        holes, before = self._holes, self._idx
        super().filter(batch_indices)
        if holes is not None:
            kept = holes[mx.array(list(batch_indices))][:, before - self._idx:] if len(batch_indices) else None
            self._holes = kept if kept is not None and bool(kept.any().item()) else None

    def extend(self, other: BatchKVCache) -> None:
        mine, theirs = self._holes, getattr(other, "_holes", None)
        rows, other_rows, own_idx, other_idx = self.offset.shape[0], other.offset.shape[0], self._idx, other._idx
        super().extend(other)
        if mine is None and theirs is None:
            return
        self._holes = mx.concatenate([_shifted(mine, rows, own_idx, self._idx),
                                      _shifted(theirs, other_rows, other_idx, self._idx)], axis=0)


def _shifted(holes: mx.array | None, rows: int, idx: int, length: int) -> mx.array:
    """Holes of a cache whose ``idx`` tokens now end at ``length`` (left-padded by the difference)."""
    kept = mx.zeros((rows, idx), dtype=mx.bool_) if holes is None else holes[:, :idx]
    if kept.shape[1] < idx:
        kept = mx.concatenate([kept, mx.zeros((rows, idx - kept.shape[1]), dtype=mx.bool_)], axis=1)
    return mx.concatenate([mx.zeros((rows, length - idx), dtype=mx.bool_), kept], axis=1)


def compacted(rows: Sequence[KVCache]) -> RaggedBatchKVCache:
    """One layer's ``RaggedBatchKVCache`` of ``rows`` (a ``KVCache`` each), without holes."""
    return RaggedBatchKVCache.merge(list(rows))
