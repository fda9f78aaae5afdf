"""Sequences decoding together in one forward pass per step, each on its own cache (MLX).

A thin layer over mlx-lm's ``GenerationBatch``: a sequence joins with its
working cache (the float ``KVCache`` per layer its prefill filled; in a hybrid model
also ``ArraysCache`` layers, or a ``CacheList`` of both per layer, which mlx-lm's
``merge``, ``extract`` and ``filter`` batch part by part) and its last
prompt token; every ``step`` gives each sequence its next tokens (whose keys and
values are then in the cache); ``remove`` takes a sequence out and hands its
cache back, exactly as long as its prompt plus the tokens it was given and used.
Caches of different lengths are left-padded into one ``BatchKVCache`` and the
padding is masked, so each sequence attends to its own tokens only.

A sequence that may speculate (no logits processors, a cache that trims exactly:
``speculation.py``; greedy, or sampling, verified by exact speculative sampling)
decodes in ``speculation.Lanes`` while every sequence decoding may: each drafts from
its own conversation, all are verified in one forward pass, and each gets as many
tokens a step as its draft earned (a row that found no draft, or whose draft failed,
gets one). When a sequence that may not speculate joins, the lanes go back into the
batch (one token a step each); when the batch holds only sequences that may, they
leave it again. Either way the state moved is the same: the cache of the tokens
handed out, and the next token, decided and not yet handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, _merge_caches, generation_stream
from mlx_lm.models.cache import CacheList, KVCache
from mlx_lm.sample_utils import greedy_sampler

from app.engine.drafting import Drafter, DraftLength, DraftSource, PromptLookup
from app.engine.sampled_drafts import Distribution
from app.engine.speculation import Lane, Lanes, can_trim_exactly

NO_STOPS = StopSequences()  # the engine decides when a sequence ends (stop tokens, stop strings, cancel)
NO_LIMIT = 1 << 30


@dataclass
class _Drafting:
    """A sequence that may speculate: its history (every token in its cache, then its
    next token once known) and its draft length."""

    lookup: Drafter
    length: DraftLength
    sampler: Callable[[mx.array], mx.array]  # its sampler in the batch
    distribution: Distribution | None  # what it samples from in a lane (None: greedy)
    key: str | None = None  # its conversation (a draft model's drafter is kept by it between turns)
    owed: int | None = None  # its next token, fed on joining the batch, not handed out yet


class DecodeBatch:
    """The decoding sequences of one model.

    Args:
        model: the model.
        max_draft: the most draft tokens a speculating sequence proposes a step (0: none).
        use_cores: called before each forward pass with whether it has several rows
            (``cores.CoreSplit.use``), or None.
        drafts: where a sequence's drafter comes from (a draft model:
            ``draft_model.DraftModel``); None: ``drafting.PromptLookup``, in the conversation.
    """

    def __init__(self, model: nn.Module, max_draft: int = 0,
                 use_cores: Callable[[bool], None] | None = None,
                 drafts: DraftSource | None = None) -> None:
        self._model = model
        self._drafts = drafts
        self._batch = GenerationBatch.empty(model, greedy_sampler)
        self._max_draft = max_draft
        self._use_cores = use_cores
        self._drafting: dict[int, _Drafting] = {}
        self._lanes = Lanes()
        # The normalized log-probabilities ``(vocab,)`` each sequence's token of the last step
        # was drawn from, by uid (the batch's rows: a speculating lane's tokens have none).
        self.logprobs: dict[int, mx.array] = {}

    def __len__(self) -> int:
        return len(self._batch) + len(self._lanes)

    def drafts(self, uid: int) -> tuple[int, int]:
        """(draft tokens proposed, accepted) for ``uid`` so far; (0, 0) if it does not speculate."""
        drafting = self._drafting.get(uid)
        return (drafting.length.drafted, drafting.length.accepted) if drafting else (0, 0)

    def add(self, uid: int, cache: list[KVCache], last_token: int, context: Sequence[int],
            sampler: Callable[[mx.array], mx.array], processors: Sequence[Any], speculate: bool = False,
            distribution: Distribution | None = None, key: str | None = None) -> None:
        """Start decoding ``uid``: ``cache`` holds its prompt but ``last_token``, which is fed now.
        ``context`` (the tokens in ``cache``) is what logits processors look back on and drafts
        are looked up in. ``speculate``: it may draft (drafts need no processors and a cache
        that trims exactly as well); ``distribution``: what ``sampler`` draws from (None: it
        samples greedily), which a sampled draft is verified against. ``key``: its conversation,
        whose drafter a draft model keeps between turns."""
        if speculate and self._max_draft > 0 and not processors and can_trim_exactly(cache):
            history = [*context, last_token]
            lookup = PromptLookup(history) if self._drafts is None else self._drafts.drafter(history, key)
            drafting = _Drafting(lookup, DraftLength(self._max_draft), sampler, distribution, key)
            self._drafting[uid] = drafting
            if not len(self._batch):
                self._lanes.add(uid, Lane(last_token, drafting.lookup, drafting.length, silent=1,
                                          distribution=distribution), cache)
                return
        self._join(uid, cache, last_token, context, sampler, processors)

    def _join(self, uid: int, cache: list[Any], token: int, context: Sequence[int],
              sampler: Callable[[mx.array], mx.array], processors: Sequence[Any]) -> None:
        """Put ``uid`` in the ``GenerationBatch``: ``token`` is fed now (not handed out)."""
        with mx.stream(generation_stream):
            joining = GenerationBatch(self._model, [uid], mx.array([token]), _merge_caches([cache]),
                                      [list(context)], [sampler], greedy_sampler, [list(processors)], [NO_STOPS],
                                      [NO_LIMIT])
            self._batch.extend(joining)

    def step(self) -> list[tuple[int, list[int]]]:
        """One forward pass for every sequence: (uid, its next tokens: one, or a speculating
        sequence's verified draft and the token after it)."""
        self._arrange()
        self.logprobs = {}
        if len(self._lanes):
            return self._lanes.step(self._model, self._before_forward)
        self._before_forward(len(self._batch))
        with mx.stream(generation_stream):
            responses = self._batch.next()
        stepped = [(r.uid, r.token) for r in responses]
        self.logprobs = {r.uid: r.logprobs for r in responses}
        out = []
        for uid, token in stepped:
            drafting = self._drafting.get(uid)
            if drafting is None:
                out.append((uid, [token]))
                continue
            drafting.lookup.extend([token])
            if drafting.owed is None:
                out.append((uid, [token]))
            else:  # its next token when it joined: already in its history
                out.append((uid, [drafting.owed, token]))
                drafting.owed = None
        return out

    def _before_forward(self, rows: int) -> None:
        if self._use_cores is not None:
            self._use_cores(rows > 1)

    def _arrange(self) -> None:
        """Speculating sequences decode in lanes while no other sequence decodes, in the batch otherwise."""
        if len(self._lanes) and len(self._batch):
            for uid in list(self._lanes.uids):
                lane, cache = self._lanes.remove(uid)
                drafting = self._drafting[uid]
                if not lane.silent:  # a lane that never stepped joins as it would have at ``add``
                    drafting.owed = lane.pending
                self._join(uid, cache, lane.pending, lane.lookup.tokens[:-1], drafting.sampler, ())
        elif not len(self._lanes) and len(self._batch) and all(
                uid in self._drafting and self._drafting[uid].owed is None for uid in self._batch.uids):
            with mx.stream(generation_stream):
                caches = [self._batch.extract_cache(i) for i in range(len(self._batch))]
                # NOTE: mlx-lm 0.32.2 (pinned) keeps the tokens it sampled last, not fed yet, here.
                pending: list[int] = self._batch._next_tokens.tolist()  # type: ignore[assignment]
                uids = list(self._batch.uids)
                self._batch.filter([])
            for uid, cache, token in zip(uids, caches, pending):
                drafting = self._drafting[uid]
                drafting.lookup.extend([token])
                self._lanes.add(uid, Lane(token, drafting.lookup, drafting.length,
                                          distribution=drafting.distribution), cache)

    def remove(self, uid: int, n_unused: int = 0) -> list[KVCache]:
        """Take ``uid`` out; returns its cache (one ``KVCache`` per layer) without the last
        ``n_unused`` tokens it was handed (those after its end, in a verified draft)."""
        drafting = self._drafting.pop(uid, None)
        if drafting is not None and self._drafts is not None:
            self._drafts.release(drafting.key, drafting.lookup)
        if uid in self._lanes.uids:
            cache = self._lanes.remove(uid)[1]
        else:
            index = self._batch.uids.index(uid)
            with mx.stream(generation_stream):
                cache = self._batch.extract_cache(index)
                self._batch.filter([i for i in range(len(self._batch)) if i != index])
        if n_unused:
            for layer in cache:
                layer.trim(n_unused)
        with mx.stream(generation_stream):
            mx.eval(cache_arrays(cache))
        return cache


def prefill(model: nn.Module, cache: list[KVCache], tokens: Sequence[int]) -> None:
    """Feed ``tokens`` into ``cache`` (one forward pass; the logits are not needed)."""
    with mx.stream(generation_stream):
        model(mx.array([list(tokens)]), cache=cache)
        mx.eval(cache_arrays(cache))


def cache_arrays(cache: list[Any]) -> list[mx.array]:
    """The arrays a working cache holds: each attention layer's keys and values, each
    recurrent layer's state (``ArraysCache``, hybrid models), and both of a layer that
    keeps both (a ``CacheList`` of the two: Falcon-H1)."""
    parts = [part for layer in cache for part in (layer.caches if isinstance(layer, CacheList) else (layer,))]
    return [x for part in parts for x in ((part.keys, part.values) if hasattr(part, "keys") else part.cache)
            if x is not None]
