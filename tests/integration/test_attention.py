"""The NumPy-softmax attention (app/engine/attention.py) against MLX's own
``scaled_dot_product_attention``: every mask kind mlx-lm passes, grouped-query
heads, one query or many, and the fallbacks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from app.engine import attention


def reference(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):  # type: ignore[no-untyped-def]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def qkv(batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, seed: int = 0):  # type: ignore[no-untyped-def]
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, n_queries, 64)), mx.random.normal((batch, kv_heads, n_keys, 64)),
            mx.random.normal((batch, kv_heads, n_keys, 64)))


FAST = attention.attention(reference)


def close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, atol=1e-5, rtol=1e-4))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("n_queries,n_keys", [(256, 256), (64, 700), (1, 5000), (300, 301)])
def test_causal_matches_mlx(heads: int, kv_heads: int, n_queries: int, n_keys: int) -> None:
    q, k, v = qkv(1, heads, kv_heads, n_queries, n_keys)
    mask = "causal" if n_queries > 1 else None
    assert close(FAST(q, k, v, cache=None, scale=0.125, mask=mask), reference(q, k, v, scale=0.125, mask=mask))


def test_sliding_window_mask_matches_mlx() -> None:
    """Gemma 3's sliding-window layers pass a 2-D boolean mask."""
    q, k, v = qkv(1, 4, 1, 128, 900)
    mask = create_causal_mask(128, 900 - 128, window_size=512)
    assert close(FAST(q, k, v, cache=None, scale=0.1, mask=mask), reference(q, k, v, scale=0.1, mask=mask))


def test_batched_left_padding_mask_matches_mlx() -> None:
    """Batched rows mask their left padding: a (rows, 1, queries, keys) mask."""
    q, k, v = qkv(3, 9, 3, 16, 4000)
    mask = create_causal_mask(16, 3984, left_padding=mx.array([0, 1000, 2500]))
    assert mask.shape == (3, 1, 16, 4000)
    assert close(FAST(q, k, v, cache=None, scale=0.125, mask=mask), reference(q, k, v, scale=0.125, mask=mask))


def test_additive_mask_matches_mlx() -> None:
    q, k, v = qkv(1, 2, 2, 64, 600)
    mask = mx.where(create_causal_mask(64, 536), 0.0, -1e9).astype(mx.float32)
    assert close(FAST(q, k, v, cache=None, scale=0.125, mask=mask), reference(q, k, v, scale=0.125, mask=mask))


def test_decode_steps_and_sinks_stay_in_mlx() -> None:
    calls = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("sinks"))
        return reference(*args, **kwargs)

    wrapped = attention.attention(spy)
    q, k, v = qkv(4, 9, 3, 1, 2000)  # one query per sequence: a decode step, batched or not
    wrapped(q, k, v, cache=None, scale=1.0, mask=None)
    q, k, v = qkv(1, 9, 3, 64, 640)
    wrapped(q, k, v, cache=None, scale=1.0, mask="causal", sinks=mx.zeros((9,)))
    assert len(calls) == 2
    wrapped(q, k, v, cache=None, scale=1.0, mask="causal")
    assert len(calls) == 2  # queries of a prefill chunk without sinks took the NumPy path


def test_softmax_in_place_over_threads() -> None:
    rows = np.random.default_rng(0).normal(size=(37, 1000)).astype(np.float32)
    expected = np.exp(rows - rows.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    attention.softmax_in_place(rows)
    np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-7)


def test_a_model_of_another_dtype_in_the_same_family_stays_in_mlx() -> None:
    """The patch is process-wide per model family: after a float32 model installed it, a
    bfloat16 model of the same family (mlx_lm.load, a benchmark's model) runs MLX's own
    attention. It raised "'bfloat16' is not a valid PEP 3118 buffer format string"."""
    q, k, v = (x.astype(mx.bfloat16) for x in qkv(1, 4, 2, 64, 64))
    out = FAST(q, k, v, cache=None, scale=0.125, mask="causal")
    assert out.dtype == mx.bfloat16
    assert mx.array_equal(out, reference(q, k, v, scale=0.125, mask="causal"))
