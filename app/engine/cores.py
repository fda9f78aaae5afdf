"""Both CPU cores on a batched decode step (Linux CPU with OpenBLAS).

A decode step with a few sequences reads every weight once, so it should cost
little more than a step with one. On a 2-core CPU it does not, for two reasons
measured by ``benchmarks/decode_step.py``: OpenBLAS splits a GEMM of a few rows
badly across its threads (a few rows cost far more than the one-row GEMV, though a
single thread does them at nearly the cost of one), and MLX runs attention,
whose cost grows with every row's context, on one thread.

So while several sequences decode, ``CoreSplit`` runs OpenBLAS on one thread and
splits the work itself over two MLX streams (each has its own thread): half of
the output features of every large projection (``SplitLinear``,
``SplitEmbedding`` for a tied output head), and half of the rows' attention. One sequence alone, or a
prefill without decoding rows, takes the plain path with OpenBLAS's own
threads, where one row's GEMV already uses both cores.

The split changes which BLAS kernel computes an output (per-column halves, rows
of attention apart), not the math: results match the plain path within float32
rounding.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.generate import generation_stream

from app.engine.attention import wraps

log = logging.getLogger(__name__)

Attention = Callable[..., mx.array]

# Weights this small are not split: reading one takes about as long as joining the two
# streams after it (benchmarks/decode_step.py), e.g. SmolLM2's 192x576 key and value projections.
MIN_SPLIT_ELEMENTS = 1 << 18


class CoreSplit:
    """Whether the model's forward passes split their work over two streams, and the
    OpenBLAS thread count that goes with it."""

    def __init__(self, set_blas_threads: Callable[[int], Any], blas_threads: int) -> None:
        self._set_blas_threads = set_blas_threads
        self._blas_threads = blas_threads
        self.helper = mx.new_thread_local_stream(mx.cpu)  # the engine thread changes with each Engine
        self.active = False

    @property
    def blas_threads(self) -> int:
        """OpenBLAS's threads when the work is not split."""
        return self._blas_threads

    def use(self, split: bool) -> None:
        """Split (one BLAS thread, two streams) or not (OpenBLAS's threads) from now on.

        Waits for work already queued first, so no BLAS call runs while its thread
        count changes.
        """
        if split == self.active:
            return
        for stream in (generation_stream, self.helper, mx.default_stream(mx.cpu)):
            mx.synchronize(stream)
        self._set_blas_threads(1 if split else self._blas_threads)
        self.active = split

    def matmul(self, x: mx.array, weight: mx.array, halves: Halves) -> mx.array:
        """``x @ weight.T``; split, the second half of the output features on the helper stream."""
        if not self.active:
            return x @ weight.T
        first = x @ halves.first.T
        with mx.stream(self.helper):
            second = x @ halves.second.T
        return mx.concatenate([first, second], axis=-1)

    def attention(self, plain: Attention) -> Attention:
        """``plain`` (mlx-lm's ``scaled_dot_product_attention``), or when active and a decode
        step has several rows, ``decode_attention`` on each half of them."""

        def split_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                            mask: Any, sinks: Any = None) -> mx.array:
            rows = queries.shape[0]
            per_row = isinstance(mask, mx.array) and mask.shape[:3] == (rows, 1, 1)
            if not self.active or rows < 2 or queries.shape[2] != 1 or sinks is not None \
                    or hasattr(cache, "bits") or (isinstance(mask, mx.array) and not per_row):
                return plain(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            half = rows // 2

            def part(lo: int, hi: int) -> mx.array:
                return decode_attention(queries[lo:hi], keys[lo:hi], values[lo:hi], scale,
                                        mask[lo:hi] if per_row else None)

            first = part(0, half)
            with mx.stream(self.helper):
                second = part(half, rows)
            return mx.concatenate([first, second], axis=0)

        split_attention.plain = plain  # type: ignore[attr-defined]
        return split_attention


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: mx.array | None) -> mx.array:
    """Attention of one new token per row, ``(rows, heads, 1, dim)``, over the rows' caches.

    The query heads that share a key/value head are the rows of one matmul against it,
    so the cache is read once per key/value head and never broadcast (MLX's CPU
    fallback for ``mx.fast.scaled_dot_product_attention`` is slower on the CPU: ``benchmarks/decode_step.py``).
    ``mask`` is ``(rows, 1, 1, keys)``: boolean (True = attend) or additive.
    """
    rows, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    scores = (queries * scale).reshape(rows, kv_heads, heads // kv_heads, dim) @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(rows, heads, 1, dim)


@dataclass(frozen=True)
class Halves:
    """The two halves of a weight's rows (output features): views of its memory, sliced
    once rather than at every call."""

    first: mx.array
    second: mx.array

    @classmethod
    def of(cls, weight: mx.array) -> Halves:
        half = weight.shape[0] // 2
        halves = cls(weight[:half], weight[half:])
        mx.eval(halves.first, halves.second)
        return halves


class SplitLinear(nn.Module):
    """A bias-free ``nn.Linear`` whose matmul ``CoreSplit`` may split."""

    def __init__(self, weight: mx.array, cores: CoreSplit) -> None:
        super().__init__()
        self.weight = weight
        self._halves = Halves.of(weight)
        self._cores = cores

    def __call__(self, x: mx.array) -> mx.array:
        return self._cores.matmul(x, self.weight, self._halves)


class SplitEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose use as the output head (tied weights) ``CoreSplit`` may split."""

    def __init__(self, weight: mx.array, cores: CoreSplit) -> None:
        nn.Module.__init__(self)  # not Embedding's: it would draw a random table first
        self.weight = weight
        self._halves = Halves.of(weight)
        self._cores = cores

    def as_linear(self, x: mx.array) -> mx.array:
        return self._cores.matmul(x, self.weight, self._halves)


_CORES: CoreSplit | None = None


def install(model: nn.Module, min_split: int = MIN_SPLIT_ELEMENTS) -> CoreSplit | None:
    """Give ``model`` split projections and split decode attention; None where this does
    not apply (not OpenBLAS, or one core).

    The attention wrapper replaces ``scaled_dot_product_attention`` in the module of each
    attention layer's class (mlx-lm's models call it by that name): it is process-wide,
    and a plain pass-through while no ``CoreSplit`` is active.
    """
    global _CORES
    blas = ctypes.CDLL(None)
    if not hasattr(blas, "openblas_set_num_threads") or mx.default_device() != mx.cpu:
        return None
    if _CORES is None:  # OpenBLAS's own thread count, read once: a split in use sets it to 1
        threads = int(blas.openblas_get_num_threads())
        if threads < 2:
            return None
        _CORES = CoreSplit(blas.openblas_set_num_threads, threads)
    cores = _CORES

    def split(_path: str, module: nn.Module) -> nn.Module:
        if type(module) is nn.Linear and "bias" not in module and module.weight.size >= min_split:
            return SplitLinear(module.weight, cores)
        if type(module) is nn.Embedding:
            return SplitEmbedding(module.weight, cores)
        return module

    model.update_modules(tree_map_with_path(split, model.leaf_modules(), is_leaf=nn.Module.is_module))
    for layer in getattr(model, "layers", []):
        attention = getattr(layer, "self_attn", None)
        family = sys.modules[type(attention).__module__] if attention is not None else None
        plain = getattr(family, "scaled_dot_product_attention", None)
        if plain is not None and not wraps(plain, "split_attention"):
            setattr(family, "scaled_dot_product_attention", cores.attention(plain))  # noqa: B010
    log.info("batched decode steps split over 2 streams (OpenBLAS: %d threads alone, 1 when split)", cores.blas_threads)
    return cores
