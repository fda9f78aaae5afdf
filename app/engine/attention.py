"""Attention on the CPU backend, with its softmax in NumPy.

On a long context a prefill chunk's time is almost all softmax: 256 new tokens
over a 6K-token cache are 14M attention weights per layer, and MLX's CPU
backend computes ``exp`` one value at a time on one thread, while NumPy's
``exp`` is vectorized. So on the CPU, ``attention`` leaves the two matmuls (scores, weighted values) to
MLX and BLAS, evaluates the scores, and runs the softmax in NumPy in place on
the scores' own memory (a writable view: no copy either way), its rows split
over ``THREADS`` threads (NumPy releases the GIL). ``benchmarks/prefill_chunks.py``
measures the gain (docs/benchmarks.md).

The math is the softmax MLX computes (float32, the row maximum subtracted
first); results differ from MLX's in float32 rounding only. Decode steps (one
query per sequence) stay in MLX: their ``exp`` is small, evaluating in the middle
of the forward pass costs about as much, and a rule that does not depend on the
batch or the chunk size keeps every sequence's numbers independent of what it
runs beside (a greedy answer is the same alone and batched, whatever the load).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger(__name__)

Attention = Callable[..., mx.array]

THREADS = max(1, min(2, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="semantic-softmax") if THREADS > 1 else None


def _softmax_rows(rows: np.ndarray) -> None:
    """Softmax of each row of ``rows``, in place (a row of -inf stays NaN, as in MLX)."""
    np.subtract(rows, rows.max(axis=-1, keepdims=True), out=rows)
    np.exp(rows, out=rows)
    np.divide(rows, rows.sum(axis=-1, keepdims=True), out=rows)


def softmax_in_place(rows: np.ndarray) -> None:
    """Softmax over the last axis of a 2-D array, in place, its rows shared among threads."""
    n = rows.shape[0]
    if _POOL is None or n < 2 * THREADS:
        _softmax_rows(rows)
        return
    bounds = [n * i // THREADS for i in range(THREADS + 1)]
    list(_POOL.map(_softmax_rows, [rows[lo:hi] for lo, hi in zip(bounds, bounds[1:])]))


def _apply_mask(scores: np.ndarray, mask: Any, n_queries: int) -> None:
    """Mask ``scores`` ``(batch, kv_heads, heads per kv head, queries, keys)`` in place:
    ``"causal"`` aligned to the last keys, or an MLX array, boolean (True = attend) or
    additive, broadcastable to ``(batch, heads, queries, keys)``."""
    n_keys = scores.shape[-1]
    if isinstance(mask, str):
        if n_queries > 1:
            above = np.triu(np.ones((n_queries, n_queries), dtype=bool), 1)
            scores[..., n_keys - n_queries:][..., above] = -np.inf
        return
    array = np.array(mask)
    if array.ndim == 4:  # (batch, heads or 1, queries, keys)
        groups = (scores.shape[1], scores.shape[2]) if array.shape[1] > 1 else (1, 1)
        array = array.reshape(array.shape[0], *groups, *array.shape[2:])
    if array.dtype == np.bool_:
        np.putmask(scores, ~np.broadcast_to(array, scores.shape), -np.inf)
    else:
        np.add(scores, array, out=scores)


def attention(plain: Attention) -> Attention:
    """mlx-lm's ``scaled_dot_product_attention`` with the softmax in NumPy where that pays;
    ``plain`` where it does not apply (decode steps, quantized caches, attention sinks, and
    any dtype but float32: NumPy has no bfloat16)."""

    def numpy_softmax_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                                mask: Any, sinks: Any = None) -> mx.array:
        batch, heads, n_queries, dim = queries.shape
        kv_heads, n_keys = keys.shape[1], keys.shape[2]
        if n_queries == 1 or sinks is not None or hasattr(cache, "bits") or heads % kv_heads \
                or queries.dtype != mx.float32:  # the patch is process-wide: another model may not be float32
            return plain(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        per_kv = heads // kv_heads
        # The query heads sharing a key/value head are rows of one matmul: the cache is never broadcast.
        scores = (queries * scale).reshape(batch, kv_heads, per_kv * n_queries, dim) @ keys.swapaxes(-1, -2)
        mx.eval(scores)
        view = np.array(scores, copy=False)  # the scores' own memory
        if mask is not None:
            _apply_mask(view.reshape(batch, kv_heads, per_kv, n_queries, n_keys), mask, n_queries)
        softmax_in_place(view.reshape(-1, n_keys))
        out = (scores @ values).reshape(batch, heads, n_queries, -1)
        return out.astype(queries.dtype)

    numpy_softmax_attention.plain = plain  # type: ignore[attr-defined]
    return numpy_softmax_attention


def install(model: nn.Module) -> bool:
    """Give ``model``'s attention layers the NumPy softmax (float32 on the CPU only);
    returns whether it applies.

    Replaces ``scaled_dot_product_attention`` in the module of each attention layer's
    class (mlx-lm's models call it by that name), process-wide: every model of that
    family loaded in this process uses it. Install before ``cores.install``, whose
    split decode wraps whatever attention the module has.
    """
    if mx.default_device() != mx.cpu:
        return False
    installed = False
    for layer in getattr(model, "layers", []):
        module = getattr(layer, "self_attn", None)
        family = sys.modules[type(module).__module__] if module is not None else None
        current = getattr(family, "scaled_dot_product_attention", None)
        if current is None:
            continue
        installed = True
        if not wraps(current, "numpy_softmax_attention"):
            setattr(family, "scaled_dot_product_attention", attention(current))  # noqa: B010  (family: Module | None)
    if installed:
        log.info("attention softmax in NumPy on %d threads (the CPU backend's exp is scalar)", THREADS)
    return installed


def wraps(fn: Any, name: str) -> bool:
    """Whether ``fn`` is, or wraps through ``.plain``, a function called ``name``."""
    while fn is not None:
        if getattr(fn, "__name__", "") == name:
            return True
        fn = getattr(fn, "plain", None)
    return False
