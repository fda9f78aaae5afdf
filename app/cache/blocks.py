"""KV data <-> quantized blocks (MLX).

A block holds every layer's keys and values for a span of at most
``BLOCK_TOKENS`` tokens, quantized with MLX's affine quantization (group size
64 along the head dimension; scales and biases kept in float16, which is what
makes 4-bit 28.1% of FP16). The ``KVFormat`` says the bits of keys and of
values (4 by default; 8-bit keys keep the answers closer to float KV, see
benchmarks/kv_fidelity.py), and whether each head's vectors are rotated by a
normalized Hadamard matrix before quantizing (``q4r``): the rotation spreads a few
large channels over all of them, so a group's scale fits its values better; the
matrix is its own inverse, applied again after dequantizing. Quantization groups
never cross tokens, so a span quantizes the same alone or inside a longer cache.
The bits follow from the arrays' shapes; the rotation from the format.

Attention runs on a transient dequantized float32 copy (``to_working_cache``):
on Linux CPU float32 goes through BLAS while ``quantized_matmul`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from app.cache.hashing import BLOCK_TOKENS
from app.types import KV_FORMAT_NAMES

GROUP_SIZE = 64
SCALE_DTYPE = mx.float16


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Bits of the stored keys and values, and whether heads are rotated first."""

    name: str
    key_bits: int
    value_bits: int
    rotated: bool = False

    @property
    def fingerprint(self) -> str:
        """Part of every model fingerprint: caches of another format never match."""
        bits = f"q{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        return f"affine-{bits}{'-hadamard' if self.rotated else ''}-g{GROUP_SIZE}-s16-b{BLOCK_TOKENS}"

    @property
    def bytes_per_value(self) -> float:
        """Mean stored bytes per key or value element (data, then a float16 scale and bias per group)."""
        return ((self.key_bits + self.value_bits) / 2 + 2 * 16 / GROUP_SIZE) / 8


KV_FORMATS = {f.name: f for f in (KVFormat("q4", 4, 4), KVFormat("q4r", 4, 4, rotated=True),
                                   KVFormat("k8v4", 8, 4), KVFormat("q8", 8, 8))}
assert tuple(KV_FORMATS) == KV_FORMAT_NAMES
DEFAULT_KV_FORMAT = KV_FORMATS["q4"]

# Blocks align with mlx-lm's own cache growth step; keep them in lockstep.
assert QuantizedKVCache.step == BLOCK_TOKENS == KVCache.step

ARRAY_NAMES = ("k_w", "k_s", "k_b", "v_w", "v_s", "v_b")


@dataclass(frozen=True)
class KVBlock:
    """Quantized KV of one token span: ``layers[i]`` has the six arrays of ARRAY_NAMES."""

    n_tokens: int
    layers: tuple[tuple[mx.array, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer)

    def to_arrays(self) -> dict[str, mx.array]:
        """Flat name -> array mapping, for safetensors."""
        return {f"{i}.{name}": array for i, layer in enumerate(self.layers)
                for name, array in zip(ARRAY_NAMES, layer)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, mx.array], n_layers: int, n_tokens: int) -> KVBlock:
        """Inverse of ``to_arrays``. Raises KeyError if an array is missing."""
        layers = tuple(tuple(arrays[f"{i}.{name}"] for name in ARRAY_NAMES) for i in range(n_layers))
        block = cls(n_tokens, layers)
        block.check()
        return block

    def check(self) -> None:
        """Raise ValueError unless every array covers ``n_tokens`` tokens."""
        for layer in self.layers:
            if any(array.ndim != 4 or array.shape[2] != self.n_tokens for array in layer):
                raise ValueError("block arrays do not match its token count")


def join_blocks(blocks: list[KVBlock]) -> KVBlock:
    """One block spanning ``blocks`` in order (quantized data is per token, so
    concatenating along the token axis is exact)."""
    if len(blocks) == 1:
        return blocks[0]
    layers = tuple(tuple(mx.concatenate([b.layers[i][a] for b in blocks], axis=2) for a in range(len(ARRAY_NAMES)))
                   for i in range(len(blocks[0].layers)))
    mx.eval([a for layer in layers for a in layer])  # evaluated here, on the engine thread
    return KVBlock(sum(b.n_tokens for b in blocks), layers)


def slice_block(block: KVBlock, start: int, end: int) -> KVBlock:
    """Tokens ``[start, end)`` of a block, still quantized, in arrays of their own
    (not views that would keep the whole source alive)."""
    if (start, end) == (0, block.n_tokens):
        return block
    sliced = KVBlock(end - start, tuple(tuple(mx.contiguous(a[:, :, start:end]) for a in layer)
                                        for layer in block.layers))
    mx.eval([a for layer in sliced.layers for a in layer])
    return sliced


def _quantize(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    weights, scales, biases = mx.quantize(x, group_size=GROUP_SIZE, bits=bits)
    return weights, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)


def _dequantize(w: mx.array, s: mx.array, b: mx.array, dtype: mx.Dtype) -> mx.array:
    bits = w.shape[-1] * 32 // (s.shape[-1] * GROUP_SIZE)  # packed uint32 words per group of values
    return mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits).astype(dtype)


def _rotate(x: mx.array, kv_format: KVFormat) -> mx.array:
    """Each head vector times the normalized Hadamard matrix (its own inverse), if the format rotates."""
    if not kv_format.rotated:
        return x
    return mx.hadamard_transform(x.astype(mx.float32), scale=x.shape[-1] ** -0.5).astype(x.dtype)


def quantize_span(cache: list[KVCache], start: int, end: int, kv_format: KVFormat = DEFAULT_KV_FORMAT) -> KVBlock:
    """Quantize tokens ``[start, end)`` of a float working cache into a block."""
    layers = []
    for layer in cache:
        keys = _rotate(layer.keys[..., start:end, :], kv_format)
        values = _rotate(layer.values[..., start:end, :], kv_format)
        layers.append((*_quantize(keys, kv_format.key_bits), *_quantize(values, kv_format.value_bits)))
    block = KVBlock(end - start, tuple(layers))
    mx.eval([a for layer in block.layers for a in layer])
    return block


def to_working_cache(blocks: list[KVBlock], n_layers: int, n_tokens: int, dtype: mx.Dtype,
                     kv_format: KVFormat = DEFAULT_KV_FORMAT) -> list[KVCache]:
    """A float KV cache holding the first ``n_tokens`` tokens of ``blocks`` (stored in ``kv_format``).

    With no blocks, an empty cache (one ``KVCache`` per layer: sliding-window
    layers keep every token too, and the model masks by window).
    """
    cache = [KVCache() for _ in range(n_layers)]
    if n_tokens == 0:
        return cache
    for i, layer in enumerate(cache):
        keys = mx.concatenate([_dequantize(*b.layers[i][:3], dtype) for b in blocks], axis=2)
        values = mx.concatenate([_dequantize(*b.layers[i][3:], dtype) for b in blocks], axis=2)
        layer.state = (_rotate(keys[..., :n_tokens, :], kv_format), _rotate(values[..., :n_tokens, :], kv_format),
                       n_tokens)
    mx.eval([x for layer in cache for x in (layer.keys, layer.values)])
    return cache


def overwrite_with_stored(cache: list[KVCache], block: KVBlock, start: int,
                          kv_format: KVFormat = DEFAULT_KV_FORMAT) -> None:
    """Replace tokens ``[start, start + block.n_tokens)`` of a working cache with
    the dequantized block, so the float copy holds exactly what a reload from
    disk would give (the next turn must not depend on which of the two it got)."""
    end = start + block.n_tokens
    for layer, data in zip(cache, block.layers):
        layer.keys[..., start:end, :] = _rotate(_dequantize(*data[:3], layer.keys.dtype), kv_format)
        layer.values[..., start:end, :] = _rotate(_dequantize(*data[3:], layer.values.dtype), kv_format)
    mx.eval([x for layer in cache for x in (layer.keys, layer.values)])
