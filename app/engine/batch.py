"""Sequences decoding together in one forward pass per step, each on its own cache (MLX).

A thin layer over mlx-lm's ``GenerationBatch``: a sequence joins with its
working cache (the float ``KVCache`` per layer its prefill filled) and its last
prompt token; every ``step`` gives each sequence its next token (whose keys and
values are then in the cache); ``remove`` takes a sequence out and hands its
cache back, exactly as long as its prompt plus the tokens it was given.
Caches of different lengths are left-padded into one ``BatchKVCache`` and the
padding is masked, so each sequence attends to its own tokens only.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, _merge_caches, generation_stream
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import greedy_sampler

NO_STOPS = StopSequences()  # the engine decides when a sequence ends (stop tokens, stop strings, cancel)
NO_LIMIT = 1 << 30


class DecodeBatch:
    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._batch = GenerationBatch.empty(model, greedy_sampler)

    def __len__(self) -> int:
        return len(self._batch)

    def add(self, uid: int, cache: list[KVCache], last_token: int, context: Sequence[int],
            sampler: Callable[[mx.array], mx.array], processors: Sequence[Any]) -> None:
        """Start decoding ``uid``: ``cache`` holds its prompt but ``last_token``, which is fed now.
        ``context`` (the tokens in ``cache``) is what logits processors look back on."""
        with mx.stream(generation_stream):
            joining = GenerationBatch(self._model, [uid], mx.array([last_token]), _merge_caches([cache]),
                                      [list(context)], [sampler], greedy_sampler, [tuple(processors)], [NO_STOPS],
                                      [NO_LIMIT])
            self._batch.extend(joining)

    def step(self) -> list[tuple[int, int]]:
        """One forward pass for every sequence: (uid, its next token)."""
        with mx.stream(generation_stream):
            return [(r.uid, r.token) for r in self._batch.next()]

    def remove(self, uid: int) -> list[KVCache]:
        """Take ``uid`` out of the batch; returns its cache (one ``KVCache`` per layer)."""
        index = self._batch.uids.index(uid)
        with mx.stream(generation_stream):
            cache = self._batch.extract_cache(index)
            self._batch.filter([i for i in range(len(self._batch)) if i != index])
            mx.eval(cache_arrays(cache))
        return cache


def prefill(model: nn.Module, cache: list[KVCache], tokens: Sequence[int]) -> None:
    """Feed ``tokens`` into ``cache`` (one forward pass; the logits are not needed)."""
    with mx.stream(generation_stream):
        model(mx.array([list(tokens)]), cache=cache)
        mx.eval(cache_arrays(cache))


def cache_arrays(cache: list[Any]) -> list[mx.array]:
    """The arrays a working cache holds: each attention layer's keys and values, each
    recurrent layer's state (``ArraysCache``, hybrid models)."""
    return [x for layer in cache for x in ((layer.keys, layer.values) if hasattr(layer, "keys") else layer.cache)
            if x is not None]
