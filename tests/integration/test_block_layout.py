"""A block file holds one array a name with the layers stacked (6 arrays, not 6 a layer), so a
restart reads, verifies and converts a few arrays a file; files of the layout before, one array
a layer, still load, and so do blocks of a model whose layers differ, which keep that layout."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.cache import files
from app.cache.blocks import ARRAY_NAMES, CHANNEL_ARRAY_NAMES, FLOAT_ARRAY_NAMES, KVBlock, quantize_span
from app.cache.formats import KV_FORMATS
from mlx_lm.models.cache import KVCache


def _cache(head_dims: list[int], n_tokens: int) -> list[KVCache]:
    """A float working cache of random keys and values, one layer per head_dim given."""
    mx.random.seed(1)
    cache = []
    for head_dim in head_dims:
        layer = KVCache()
        layer.update_and_fetch(mx.random.normal((1, 2, n_tokens, head_dim)), mx.random.normal((1, 2, n_tokens, head_dim)))
        cache.append(layer)
    return cache


def _same(a: KVBlock, b: KVBlock) -> bool:
    return a.n_tokens == b.n_tokens and len(a.layers) == len(b.layers) and all(
        x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y)
        for la, lb in zip(a.layers, b.layers) for x, y in zip(la, lb))


@pytest.mark.parametrize("name", ["q8", "q4c", "f16"])
def test_a_blocks_file_holds_one_array_a_name_and_reads_back_exactly(name: str, tmp_path: Path) -> None:
    kv_format = KV_FORMATS[name].for_head_dim(64)
    block = quantize_span(_cache([64] * 4, 256), 0, 256, kv_format)
    arrays = block.to_numpy()
    names = {6: ARRAY_NAMES, 7: CHANNEL_ARRAY_NAMES, 2: FLOAT_ARRAY_NAMES}[len(block.layers[0])]
    assert sorted(arrays) == sorted(names) and all(a.shape[0] == 4 for a in arrays.values())
    path = tmp_path / "block.safetensors"
    files.write(path, arrays, {"n_tokens": "256"})
    read, _ = files.read(path)
    assert _same(KVBlock.from_numpy(read, 4, 256), block)
    with pytest.raises(ValueError):  # a file of a model with another number of layers
        KVBlock.from_numpy(read, 5, 256)


def test_a_file_of_the_layout_before_stacking_still_loads(tmp_path: Path) -> None:
    block = quantize_span(_cache([64] * 3, 256), 0, 256, KV_FORMATS["q8"])
    path = tmp_path / "old.safetensors"
    files.write(path, {name: np.array(a, copy=False) for name, a in block.to_arrays().items()}, {})
    read, _ = files.read(path)
    assert "0.k_w" in read and len(read) == 3 * 6
    assert _same(KVBlock.from_numpy(read, 3, 256), block)


def test_layers_of_different_shapes_keep_an_array_a_layer() -> None:
    block = quantize_span(_cache([64, 128, 64], 256), 0, 256, KV_FORMATS["q8"])
    arrays = block.to_numpy("tail.")
    assert len(arrays) == 3 * 6 and "tail.1.k_w" in arrays
    assert _same(KVBlock.from_numpy({k.removeprefix("tail."): v for k, v in arrays.items()}, 3, 256), block)
