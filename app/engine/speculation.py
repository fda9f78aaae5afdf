"""Lossless speculative decoding of one sequence with prompt-lookup drafts (MLX).

A ``Lane`` is a sequence decoding on its own cache outside mlx-lm's
``GenerationBatch`` (``batch.DecodeBatch`` puts a sequence in one when it decodes
alone). Its state is the batch's: the cache holds every token handed out so far,
and ``pending``, the next token, is decided but not yet in the cache nor handed
out. A step feeds ``[pending, *draft]`` in one forward pass (the draft from
``drafting.PromptLookup``, or from a draft model: ``draft_model.ModelDraft``), takes
the greedy token after each position, keeps the draft's longest prefix that agrees
with them, and trims the cache back over the rest (``KVCache.trim``). It hands out ``pending`` and the accepted draft
tokens; the model's own token after them is the new ``pending``. Every token
handed out is therefore the one greedy decoding would have produced (up to
float32 rounding between a one-row and a several-row forward pass, as between
a prompt's prefill chunkings): drafts change the speed, never the text.

A lane that samples (its ``distribution``, ``sampled_drafts.token_distribution``)
verifies the draft by exact speculative sampling instead
(``sampled_drafts.accept_sampled``): each token handed out has the distribution plain
sampling would give it, and the token after the accepted draft is drawn from the
residual or, after a wholly accepted draft, from the model's distribution there.

Only sequences without logits processors speculate, and only on caches
that can be cut back exactly (plain ``KVCache`` per layer; the engine's working caches
of sliding-window models are, the model masking by window): a ``RotatingKVCache``
or a recurrent ``ArraysCache`` (alone or in a ``CacheList``, as Falcon-H1 keeps it
beside its KV) loses state it cannot get back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from app.engine.drafting import Drafter, DraftLength
from app.engine.ragged_cache import RaggedBatchKVCache, compacted
from app.engine.sampled_drafts import Distribution, accept_sampled


def can_trim_exactly(cache: Sequence[Any]) -> bool:
    """Whether every layer of ``cache`` is a plain ``KVCache`` (cut back to any length exactly)."""
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def greedy_tokens(logits: mx.array) -> mx.array:
    """The greedy token of each row of ``logits`` ``(rows, vocab)``, computed as mlx-lm's
    ``GenerationBatch`` does (argmax of the normalized log-probabilities), so that a
    tie resolves the same way on either path."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


@dataclass
class Lane:
    """One speculating sequence's state: ``lookup`` holds every token in its cache and then
    ``pending``. ``silent``: how many of the next tokens fed are not handed out (a sequence
    that starts here feeds its last prompt token first, as ``GenerationBatch`` does when it
    joins). ``distribution``: what it samples from (None: greedy), with ``rng`` drawing the
    acceptances and tokens."""

    pending: int
    lookup: Drafter
    length: DraftLength
    silent: int = 0
    distribution: Distribution | None = None
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def propose(self) -> list[int]:
        """This step's draft (maybe none)."""
        want = self.length.want()
        return self.lookup.draft(want) if want else []

    def settle(self, logits: mx.array, draft: list[int]) -> tuple[int, list[int]]:
        """Verify ``draft`` from the logits ``(len(draft) + 1, vocab)`` at the positions fed
        (``pending`` and the draft): (how many draft tokens hold, the tokens handed out)."""
        fed = [self.pending, *draft]
        n, after = self._verify(logits, draft)
        self.length.update(len(draft), n)
        self.pending = after
        self.lookup.extend([*draft[:n], self.pending])
        out = fed[:n + 1]
        if self.silent:
            dropped, self.silent = min(self.silent, len(out)), max(0, self.silent - len(out))
            out = out[dropped:]
        return n, out

    def _verify(self, logits: mx.array, draft: list[int]) -> tuple[int, int]:
        """(how many draft tokens hold, the token after them): greedily, or by exact
        speculative sampling."""
        if self.distribution is not None:
            return accept_sampled(np.array(self.distribution(logits.astype(mx.float32))), draft, self.rng)
        predicted: list[int] = greedy_tokens(logits).tolist()  # type: ignore[assignment]  # one row of ints
        n = 0
        while n < len(draft) and draft[n] == predicted[n]:
            n += 1
        return n, predicted[n]


class Lanes:
    """Speculating sequences decoding together: one forward pass a step feeds each its
    ``pending`` token and its draft, padded to the longest (``[pending, *draft, pad...]``),
    and each keeps what its own verification accepts.

    One sequence decodes on its own cache (a ``KVCache`` per layer, cut back with
    ``trim``); several share a ``RaggedBatchKVCache`` per layer, where each row drops its
    own rejected and padding positions (``trim_rows``). Rows join and leave by extract and
    merge, which also clears the holes; so does a step after which a row holds more than
    ``MAX_HOLES`` of them.
    """

    MAX_HOLES = 256

    def __init__(self) -> None:
        self.uids: list[int] = []
        self._lanes: list[Lane] = []
        self._cache: list[Any] = []  # per layer: one row's KVCache, or several rows' RaggedBatchKVCache
        self._holes: list[int] = []  # per row

    def __len__(self) -> int:
        return len(self.uids)

    def add(self, uid: int, lane: Lane, cache: list[Any]) -> None:
        """``uid`` decodes here from now on; ``cache`` holds every token of its ``lookup`` but ``pending``."""
        if not self.uids:
            self._cache = cache
        else:
            self._rebuild([*self._caches(), cache])
        self.uids.append(uid)
        self._lanes.append(lane)
        self._holes = [0] * len(self.uids)

    def remove(self, uid: int) -> tuple[Lane, list[Any]]:
        """Take ``uid`` out: its state and its own cache (a ``KVCache`` per layer)."""
        index = self.uids.index(uid)
        lane = self._lanes.pop(index)
        self.uids.pop(index)
        self._holes.pop(index)
        if not self.uids:
            cache, self._cache = self._own(index), []
            return lane, cache
        cache = self._own(index)
        if len(self.uids) == 1:
            self._cache = self._own(1 - index)
        else:
            rest = [i for i in range(len(self.uids) + 1) if i != index]
            for layer in self._cache:
                layer.filter(rest)
        return lane, cache

    def step(self, model: nn.Module, before_forward: Any = None) -> list[tuple[int, list[int]]]:
        """Feed every row its ``pending`` token and a draft; returns (uid, the tokens handed out)."""
        drafts = [lane.propose() for lane in self._lanes]
        width = 1 + max(len(draft) for draft in drafts)
        fed = [[lane.pending, *draft] + [lane.pending] * (width - 1 - len(draft))
               for lane, draft in zip(self._lanes, drafts)]
        if before_forward is not None:
            before_forward(len(fed) * width)
        out, drops = [], []
        with mx.stream(generation_stream):
            logits = model(mx.array(fed), cache=self._cache)
            for row, (lane, draft) in enumerate(zip(self._lanes, drafts)):
                n, tokens = lane.settle(logits[row, :len(draft) + 1], draft)
                out.append((self.uids[row], tokens))
                drops.append(width - 1 - n)
            self._trim(drops)
        return out

    def _trim(self, drops: list[int]) -> None:
        if len(self.uids) == 1:
            if drops[0]:
                for layer in self._cache:
                    layer.trim(drops[0])
            return
        for layer in self._cache:
            layer.trim_rows(drops)
        least = min(drops)
        self._holes = [holes + drop - least for holes, drop in zip(self._holes, drops)]
        if max(self._holes) > self.MAX_HOLES:
            self._rebuild(self._caches())
            self._holes = [0] * len(self.uids)

    def _own(self, index: int) -> list[Any]:
        """Row ``index``'s cache on its own (one ``KVCache`` per layer, without holes)."""
        if not isinstance(self._cache[0], RaggedBatchKVCache):
            return self._cache
        return [layer.extract(index) for layer in self._cache]

    def _caches(self) -> list[list[Any]]:
        return [self._own(index) for index in range(len(self.uids))]

    def _rebuild(self, caches: list[list[Any]]) -> None:
        self._cache = [compacted([cache[layer] for cache in caches]) for layer in range(len(caches[0]))]
