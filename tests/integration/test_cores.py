"""Splitting a batched decode step over both CPU cores (app/engine/cores.py) computes what the
plain path computes: attention against MLX's own, a real mlx-lm model's forward pass with
and without the split, and OpenBLAS's thread count switched and restored."""

from __future__ import annotations

import ctypes
import os
from typing import Iterator

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from app.engine import cores
from app.engine.blas import blas_in_use

TINY = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=160,
                       num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
                       tie_word_embeddings=True)


def test_decode_attention_equals_mlx_attention_with_left_padding() -> None:
    rows, heads, kv_heads, dim, length = 3, 6, 2, 16, 40
    keys, values = (mx.random.normal((rows, kv_heads, length, dim), key=mx.random.key(i)) for i in (1, 2))
    queries = mx.random.normal((rows, heads, 1, dim), key=mx.random.key(3))
    padding = mx.array([0, 7, 31])  # row r attends to its last length - padding[r] keys only
    allowed = (mx.arange(length)[None, :] >= padding[:, None]).reshape(rows, 1, 1, length)
    for mask in (None, allowed, mx.where(allowed, 0.0, -1e9)):
        ours = cores.decode_attention(queries, keys, values, 0.25, mask)
        theirs = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


@pytest.fixture
def split_model() -> Iterator[tuple[llama.Model, cores.CoreSplit]]:
    if not blas_in_use().startswith("openblas") or (os.cpu_count() or 1) < 2:
        pytest.skip("the split applies to OpenBLAS on two cores or more")
    model = llama.Model(TINY)
    mx.eval(model.parameters())
    split = cores.install(model, min_split=0)  # this model's weights are all small
    assert split is not None
    yield model, split
    split.use(False)


def forward(model: llama.Model, prompts: list[list[int]], steps: int) -> list[mx.array]:
    """Prefill ``prompts`` (one row each, equal lengths), then decode ``steps`` greedy tokens:
    the logits of every step."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)[:, None]
        logits = model(token, cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
    return out


def test_a_split_decode_step_equals_the_plain_one(split_model: tuple[llama.Model, cores.CoreSplit]) -> None:
    model, split = split_model
    assert type(model.layers[0].mlp.down_proj) is cores.SplitLinear
    assert type(model.model.embed_tokens) is cores.SplitEmbedding
    prompts = [[(7 * row + 3 * i) % TINY.vocab_size for i in range(12)] for row in range(4)]
    plain = forward(model, prompts, 3)
    split.use(True)
    together = forward(model, prompts, 3)
    for a, b in zip(plain, together):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_the_split_runs_openblas_on_one_thread_and_restores_it(
        split_model: tuple[llama.Model, cores.CoreSplit]) -> None:
    _, split = split_model
    blas = ctypes.CDLL(None)
    before = blas.openblas_get_num_threads()
    assert before >= 2
    split.use(True)
    assert split.active and blas.openblas_get_num_threads() == 1
    split.use(False)
    assert not split.active and blas.openblas_get_num_threads() == before
