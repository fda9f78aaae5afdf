"""KV data <-> quantized blocks (MLX).

A block holds every layer's keys and values for a span of at most
``BLOCK_TOKENS`` tokens, quantized with MLX's affine quantization in groups of
64 values with float16 scales and biases (which is what makes 4-bit 28.1% of
FP16; 32 values along heads that 64 does not divide: ``KVFormat.for_head_dim``).
The ``KVFormat`` (``formats.py``, no MLX) says how:

- per token (``q4``, ``k8v4``, ``q8``): each head vector of each token in groups
  of 64 (or 32) along the head dimension; optionally after rotating each head vector by
  a normalized Hadamard matrix (``q4r``), which spreads a few large channels over
  all of them so a group's scale fits its values better (the matrix is its own
  inverse, applied again after dequantizing). A span quantizes the same alone or
  inside a longer cache, so blocks can be cut and joined at any token.
- keys per channel (``q4c``, after KIVI): each key channel quantized along time
  in groups of 64 tokens (keys have a few channels far larger than the rest, the
  same in every token), values per token after the rotation. The newest keys
  (an incomplete group, and one more group) stay float16; a later turn quantizes
  their groups from them (float data, never quantized data: see
  ``KVFormat.grouped_tokens`` and ``KVFormat.reusable``). Blocks are cut and
  joined only at group boundaries, and only the last one holds float16 keys.
- not quantized: ``f16`` keeps keys and values as float16, the near-lossless
  choice; ``f32`` keeps the float32 the model computes, exact: a reused cache holds
  what a cold prefill computes (never chosen by ``auto``; pinned where answers must
  not move, and by the warm-equals-cold tests).

Attention runs on a transient dequantized float copy (``to_working_cache``):
on Linux CPU float32 goes through BLAS while ``quantized_matmul`` does not.
The copy is built where the model runs (``working_streams``): on a GPU, on its
stream; on the CPU, dequantizing is elementwise work that MLX runs on one thread
per stream, so the layers alternate between two streams. The output has room for
the next prefill step (``capacity``): a cache loaded after a restart is ready in
half the time, and its first chunk does not copy it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from app.cache.formats import DEFAULT_KV_FORMAT, TIME_GROUP, KVFormat
from app.cache.hashing import BLOCK_TOKENS

SCALE_DTYPE = mx.float16

T = TypeVar("T")
Y = TypeVar("Y")

# Blocks align with mlx-lm's own cache growth step; keep them in lockstep.
assert QuantizedKVCache.step == BLOCK_TOKENS == KVCache.step

ARRAY_NAMES = ("k_w", "k_s", "k_b", "v_w", "v_s", "v_b")
# Per-channel keys: k_w / k_s / k_b are (batch, heads, head_dim, along time), k_t the float16 incomplete group.
CHANNEL_ARRAY_NAMES = ("k_w", "k_s", "k_b", "k_t", "v_w", "v_s", "v_b")
FLOAT_ARRAY_NAMES = ("k", "v")  # f16, f32: keys and values as floats, not quantized
_NAMES = {len(names): names for names in (ARRAY_NAMES, CHANNEL_ARRAY_NAMES, FLOAT_ARRAY_NAMES)}
_ALONG_TIME = {"k_w", "k_s", "k_b"}


@dataclass(frozen=True)
class KVBlock:
    """Quantized KV of one token span: ``layers[i]`` has the arrays of ARRAY_NAMES, or
    of CHANNEL_ARRAY_NAMES in a format with per-channel keys."""

    n_tokens: int
    layers: tuple[tuple[mx.array, ...], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return _NAMES[len(self.layers[0])]

    @property
    def n_grouped(self) -> int:
        """Tokens whose keys are in complete per-channel groups (per-token keys: all)."""
        if self.names is not CHANNEL_ARRAY_NAMES:
            return self.n_tokens
        return self.layers[0][CHANNEL_ARRAY_NAMES.index("k_s")].shape[-1] * TIME_GROUP

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer)

    def to_arrays(self) -> dict[str, mx.array]:
        """Flat name -> array mapping, one array a layer and name (``<layer>.<name>``)."""
        return {f"{i}.{name}": array for i, layer in enumerate(self.layers)
                for name, array in zip(self.names, layer)}

    def to_numpy(self, prefix: str = "") -> dict[str, np.ndarray]:
        """The arrays a file holds, each name after ``prefix``: one array a name, the layers
        stacked along a first axis (``k_w``: layers x batch x heads x tokens x words), where
        every layer's array of that name has one shape and dtype; else ``to_arrays``'s, one a
        layer (a model whose layers differ, and files written before stacking).

        Why stacked: a file of 6 arrays, not 6 a layer (192 in a 32-layer model), is parsed and
        verified with 6 steps of Python, not 192, so the threads that read a conversation's
        files back wait less for the GIL (docs/benchmarks.md, "Measured choices in the code")."""
        per_layer = [[np.array(a, copy=False) for a in layer] for layer in self.layers]
        if all(len({(arrays[i].shape, arrays[i].dtype) for arrays in per_layer}) == 1 for i in range(len(self.names))):
            return {prefix + name: np.stack([arrays[i] for arrays in per_layer]) for i, name in enumerate(self.names)}
        return {f"{prefix}{layer}.{name}": array for layer, arrays in enumerate(per_layer)
                for name, array in zip(self.names, arrays)}

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray], n_layers: int, n_tokens: int) -> KVBlock:
        """Inverse of ``to_numpy`` (without a prefix), for either layout: a stacked array's
        layers are made into an MLX array each. (Views of one MLX array a name were tried: on
        the CPU the working copy built from them was slower; docs/benchmarks.md, "Measured
        choices in the code".) Raises KeyError or ValueError if the arrays are not such a
        block's."""
        stacked = _NAMES.get(len(arrays)) if all("." not in name for name in arrays) else None
        if stacked is None:
            return cls.from_arrays({name: mx.array(array) for name, array in arrays.items()}, n_layers, n_tokens)
        whole = [arrays[name] for name in stacked]
        if any(a.ndim != 5 or a.shape[0] != n_layers for a in whole):
            raise ValueError("block arrays do not stack this model's layers")
        block = cls(n_tokens, tuple(tuple(mx.array(a[i]) for a in whole) for i in range(n_layers)))
        block.check()
        return block

    def file_pieces(self, name: str) -> list[np.ndarray]:
        """The bytes of array ``name`` of the file this block was read from (``from_numpy``:
        stacked, one piece a layer; or ``<layer>.<name>``, one piece), as NumPy views of this
        block's MLX arrays, which ``from_numpy`` copied them into: what a restore verifies
        (``files.Unverified``). Raises KeyError or ValueError for a name no such file holds."""
        if "." in name:
            layer, short = name.split(".", 1)
            return [np.array(self.layers[int(layer)][self.names.index(short)], copy=False)]
        j = self.names.index(name)
        return [np.array(layer[j], copy=False) for layer in self.layers]

    @classmethod
    def from_arrays(cls, arrays: dict[str, mx.array], n_layers: int, n_tokens: int) -> KVBlock:
        """Inverse of ``to_arrays``. Raises KeyError if an array is missing."""
        names = CHANNEL_ARRAY_NAMES if "0.k_t" in arrays else FLOAT_ARRAY_NAMES if "0.k" in arrays else ARRAY_NAMES
        layers = tuple(tuple(arrays[f"{i}.{name}"] for name in names) for i in range(n_layers))
        block = cls(n_tokens, layers)
        block.check()
        return block

    def check(self) -> None:
        """Raise ValueError unless every array covers ``n_tokens`` tokens (per-channel
        keys: the scales cover the grouped tokens, ``k_t`` the rest)."""
        n_grouped = self.n_grouped
        for layer in self.layers:
            for name, array in zip(self.names, layer):
                if self._axis(name) == 2:
                    ok = array.shape[2] == (self.n_tokens - n_grouped if name == "k_t" else self.n_tokens)
                else:
                    ok = name == "k_w" or array.shape[-1] * TIME_GROUP == n_grouped
                if array.ndim != 4 or not ok:
                    raise ValueError("block arrays do not match its token count")

    def _axis(self, name: str) -> int:
        return -1 if name in _ALONG_TIME and self.names is CHANNEL_ARRAY_NAMES else 2


def join_blocks(blocks: list[KVBlock]) -> KVBlock:
    """One block spanning ``blocks`` in order. Quantization groups never cross a block
    boundary (per-channel keys: only the last block may hold float16 keys), so
    concatenating along the token axis is exact."""
    if len(blocks) == 1:
        return blocks[0]
    layers = tuple(_join_layer(blocks, i) for i in range(len(blocks[0].layers)))
    mx.eval([a for layer in layers for a in layer])  # evaluated here, on the engine thread
    return KVBlock(sum(b.n_tokens for b in blocks), layers)


def _join_layer(blocks: list[KVBlock], i: int, room: int = 0) -> tuple[mx.array, ...]:
    """Layer ``i`` of ``blocks`` joined (lazily: the caller evaluates), and ``room`` zero
    tokens after them in every array along time (they dequantize to zeros; per-channel
    keys take the room in their float16 part)."""
    if len(blocks) == 1 and not room:
        return blocks[0].layers[i]
    if any(b.n_grouped != b.n_tokens for b in blocks[:-1]):
        raise ValueError("only the last block may hold float16 keys")
    first = blocks[0]
    joined = []
    for a, name in enumerate(first.names):
        parts = [b.layers[i][a] for b in blocks]
        axis = first._axis(name)
        if room and axis == 2:
            parts.append(mx.zeros((*parts[-1].shape[:2], room, parts[-1].shape[3]), dtype=parts[-1].dtype))
        joined.append(mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0])
    return tuple(joined)


def slice_block(block: KVBlock, start: int, end: int) -> KVBlock:
    """Tokens ``[start, end)`` of a block, still quantized, in arrays of their own
    (not views that would keep the whole source alive). Per-channel keys: a cut
    inside the complete groups must fall on a group boundary."""
    if (start, end) == (0, block.n_tokens):
        return block
    n_grouped = block.n_grouped
    grouped = (min(start, n_grouped), min(end, n_grouped))
    if block.names is CHANNEL_ARRAY_NAMES and any(at % TIME_GROUP and at != n_grouped for at in grouped):
        raise ValueError(f"cannot cut per-channel key groups at tokens {start}-{end}")

    def cut(name: str, array: mx.array) -> mx.array:
        if block._axis(name) == 2:
            lo, hi = (max(start - n_grouped, 0), max(end - n_grouped, 0)) if name == "k_t" else (start, end)
            return mx.contiguous(array[:, :, lo:hi])
        per_group = array.shape[-1] * TIME_GROUP // n_grouped if n_grouped else 0  # words (k_w) or scales per group
        return mx.contiguous(array[..., grouped[0] // TIME_GROUP * per_group:grouped[1] // TIME_GROUP * per_group])

    sliced = KVBlock(end - start, tuple(tuple(cut(name, a) for name, a in zip(block.names, layer))
                                        for layer in block.layers))
    mx.eval([a for layer in sliced.layers for a in layer])
    return sliced


def requantize_start(reused: list[KVBlock], n_reused: int, kv_format: KVFormat) -> int:
    """Where quantizing resumes after the first ``n_reused`` tokens of ``reused`` (the
    stored blocks a turn started from): tokens before it keep their stored data, quantizing
    dequantized values again would add error every turn. Per-channel keys resume at the
    group of the first float16 key, or of the cut."""
    begin = min(n_reused, sum(b.n_grouped for b in reused))
    return begin - begin % TIME_GROUP if kv_format.channel_keys else begin


def _quantize(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    weights, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return weights, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)


def _dequantize(w: mx.array, s: mx.array, b: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> mx.array:
    if w.size == 0:
        return mx.zeros((*s.shape[:-1], 0), dtype=dtype)
    if bits in BYTE_BITS and mx.default_device() == mx.cpu:
        return dequantize_by_bytes(w, s, b, bits, group_size, dtype)
    return mx.dequantize(w, s, b, group_size=group_size, bits=bits, dtype=dtype)


BYTE_BITS = (2, 4, 8)  # widths whose values never straddle a byte of the packed words


def dequantize_by_bytes(w: mx.array, s: mx.array, b: mx.array, bits: int, group_size: int,
                        dtype: mx.Dtype) -> mx.array:
    """Affine dequantization, ``value * scale + bias``, in float32 by elementwise ops on the
    packed words' bytes: what ``mx.dequantize`` computes given float32 scales and biases.

    The CPU backend's ``mx.dequantize`` decodes one value at a time, and with float16 scales
    (``SCALE_DTYPE``) rounds the product and the sum to float16 on the way, in software on a
    CPU without float16 arithmetic, several times slower than this (docs/benchmarks.md,
    "Measured choices in the code"). The result differs from it by at most that float16
    rounding (this one rounds less), and every working copy on the CPU comes from here, a
    turn's and one rebuilt from disk alike, so they stay equal. Values are packed from the
    low bits of each uint32 up: on a little-endian machine byte ``i`` of a word holds values
    ``i * 8 // bits`` on."""
    raw = w.view(mx.uint8)
    if bits == 8:
        values = raw
    else:
        per_byte, mask = 8 // bits, (1 << bits) - 1
        values = mx.stack([(raw >> (bits * i)) & mask for i in range(per_byte)], axis=-1)
    values = values.reshape(*s.shape, group_size).astype(mx.float32)
    out = values * s[..., None].astype(mx.float32) + b[..., None].astype(mx.float32)
    return out.reshape(*s.shape[:-1], -1).astype(dtype)


def _rotate(x: mx.array, rotate: bool) -> mx.array:
    """Each head vector times the normalized Hadamard matrix (its own inverse), if asked."""
    if not rotate:
        return x
    return mx.hadamard_transform(x.astype(mx.float32), scale=x.shape[-1] ** -0.5).astype(x.dtype)


def _filled(layer: KVCache) -> tuple[mx.array, mx.array]:
    """A working cache layer's keys and values (a layer nothing was written to has None)."""
    if layer.keys is None or layer.values is None:
        raise ValueError("a working cache layer with no keys or values")
    return layer.keys, layer.values


def quantize_span(cache: list[KVCache], start: int, end: int, kv_format: KVFormat = DEFAULT_KV_FORMAT) -> KVBlock:
    """Quantize tokens ``[start, end)`` of a float working cache into a block
    (per-channel keys: ``start`` on a group boundary, the newest keys left float16)."""
    if kv_format.channel_keys and start % TIME_GROUP:
        raise ValueError(f"per-channel key groups start at multiples of {TIME_GROUP}, not {start}")
    layers: list[tuple[mx.array, ...]] = []
    for layer in cache:
        all_keys, all_values = _filled(layer)
        keys = _rotate(all_keys[..., start:end, :], kv_format.rotate_keys)
        if not kv_format.quantized:
            float_dtype = kv_format.float_dtype
            layers.append((keys.astype(float_dtype), all_values[..., start:end, :].astype(float_dtype)))
            continue
        values = _quantize(_rotate(all_values[..., start:end, :], kv_format.rotate_values), kv_format.value_bits,
                           kv_format.group_size)
        if kv_format.channel_keys:
            whole = kv_format.grouped_tokens(end - start)
            grouped = _quantize(keys[..., :whole, :].swapaxes(-1, -2), kv_format.key_bits, TIME_GROUP)
            layers.append((*grouped, keys[..., whole:, :].astype(mx.float16), *values))
        else:
            layers.append((*_quantize(keys, kv_format.key_bits, kv_format.group_size), *values))
    block = KVBlock(end - start, tuple(layers))
    mx.eval([a for layer in block.layers for a in layer])
    return block


def dequantize_layer(data: tuple[mx.array, ...], kv_format: KVFormat, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """One layer of a block back to float keys and values (batch, heads, tokens, head_dim)."""
    if not kv_format.quantized:
        return data[0].astype(dtype), data[1].astype(dtype)
    if kv_format.channel_keys:
        grouped = _dequantize(data[0], data[1], data[2], kv_format.key_bits, TIME_GROUP, dtype).swapaxes(-1, -2)
        keys = mx.concatenate([grouped, data[3].astype(dtype)], axis=2)
    else:
        keys = _dequantize(data[0], data[1], data[2], kv_format.key_bits, kv_format.group_size, dtype)
    values = _dequantize(data[-3], data[-2], data[-1], kv_format.value_bits, kv_format.group_size, dtype)
    return _rotate(keys, kv_format.rotate_keys), _rotate(values, kv_format.rotate_values)


def to_working_cache(blocks: list[KVBlock], n_layers: int, n_tokens: int, dtype: mx.Dtype,
                     kv_format: KVFormat = DEFAULT_KV_FORMAT) -> list[KVCache]:
    """A float KV cache holding the first ``n_tokens`` tokens of ``blocks`` (stored in ``kv_format``).

    With no blocks, an empty cache (one ``KVCache`` per layer: sliding-window
    layers keep every token too, and the model masks by window).
    """
    return finish(to_working_cache_steps(blocks, n_layers, n_tokens, dtype, kv_format, n_layers))


def to_working_cache_steps(blocks: list[KVBlock], n_layers: int, n_tokens: int, dtype: mx.Dtype,
                           kv_format: KVFormat, layers_per_step: int) -> Generator[None, None, list[KVCache]]:
    """``to_working_cache`` in steps of ``layers_per_step`` layers, each evaluated before the
    step yields; returns the cache. The arrays are those one call computes: only when they
    are evaluated differs (a prefetch gives way to a request between steps)."""
    if n_tokens == 0:
        return [KVCache() for _ in range(n_layers)]
    stored = sum(b.n_tokens for b in blocks)
    room = capacity(stored) - stored  # joined before dequantizing: no float copy to make room
    return (yield from working_cache_steps(
        n_layers, lambda i: dequantize_layer(_join_layer(blocks, i, room), kv_format, dtype), n_tokens,
        layers_per_step))


def capacity(n_tokens: int) -> int:
    """Tokens a working cache's buffers hold for ``n_tokens``: room for a prefill step after them.

    mlx-lm's ``KVCache`` grows its buffers in steps of 256 tokens by copying the whole
    cache; a buffer cut to the tokens it holds would be copied (into memory the
    process touches for the first time) by the next turn's first chunk, a copy that grows
    with the conversation (docs/benchmarks.md, "Workload 2: restart").
    """
    return (n_tokens // KVCache.step + 2) * KVCache.step


def working_cache(n_layers: int, layer: Callable[[int], tuple[mx.array, mx.array]], n_tokens: int) -> list[KVCache]:
    """Caches holding the first ``n_tokens`` of each ``layer(i)``'s keys and values, evaluated
    (what follows them in the arrays is room for the next tokens), computed on
    ``working_streams()`` in turn."""
    return finish(working_cache_steps(n_layers, layer, n_tokens, n_layers))


def working_cache_steps(n_layers: int, layer: Callable[[int], tuple[mx.array, mx.array]], n_tokens: int,
                        layers_per_step: int) -> Generator[None, None, list[KVCache]]:
    """``working_cache`` in steps of ``layers_per_step`` layers, each evaluated before the step yields."""
    streams = working_streams()
    per_step = max(1, layers_per_step)
    cache: list[KVCache] = []
    for start in range(0, n_layers, per_step):
        for i in range(start, min(start + per_step, n_layers)):
            with mx.stream(streams[i % len(streams)]):
                keys, values = layer(i)
            cache.append(KVCache())
            cache[-1].state = (keys, values, n_tokens)
        mx.eval([x for layer in cache[start:] for x in (layer.keys, layer.values)])
        yield
    return cache


def finish(steps: Generator[Y, None, T], on_step: Callable[[Y], object] | None = None) -> T:
    """What a stepwise computation returns, its steps all run now (``on_step`` is given what
    each step yields)."""
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if on_step is not None:
            on_step(step)


def with_room(x: mx.array, n_tokens: int) -> mx.array:
    """The first ``n_tokens`` of ``x`` along the token axis, in a new buffer of ``capacity(n_tokens)`` tokens."""
    room = mx.zeros((*x.shape[:2], capacity(n_tokens) - n_tokens, x.shape[3]), dtype=x.dtype)
    return mx.concatenate([x[..., :n_tokens, :], room], axis=2)


def working_streams() -> tuple[mx.Stream, ...]:
    """Where a working copy is built: on the model's device and stream. A GPU model's is its
    device's default stream (CPU streams would run a GPU model's dequantization on the CPU and
    copy it over: docs/benchmarks.md, "On a GPU"); on the CPU, two streams in turn, because MLX's CPU backend runs each
    stream's elementwise work on one thread of its own."""
    device = mx.default_device()
    if device.type == mx.gpu:
        return (mx.default_stream(device),)
    return (mx.default_stream(mx.cpu), _second_stream())


_local = threading.local()


def _second_stream() -> mx.Stream:
    """A second CPU stream of the calling thread (MLX gives each stream a thread of its own)."""
    if not hasattr(_local, "stream"):
        _local.stream = mx.new_thread_local_stream(mx.cpu)
    return _local.stream


def overwrite_with_stored(cache: list[KVCache], block: KVBlock, start: int,
                          kv_format: KVFormat = DEFAULT_KV_FORMAT) -> None:
    """Replace tokens ``[start, start + block.n_tokens)`` of a working cache with
    the dequantized block, so the float copy holds exactly what a reload from
    disk would give (the next turn must not depend on which of the two it got)."""
    end = start + block.n_tokens
    for layer, data in zip(cache, block.layers):
        held_keys, held_values = _filled(layer)
        keys, values = dequantize_layer(data, kv_format, held_keys.dtype)
        held_keys[..., start:end, :] = keys
        held_values[..., start:end, :] = values
    mx.eval([x for layer in cache for x in _filled(layer)])


def copy_prefix(cache: list[KVCache], n_tokens: int) -> list[KVCache]:
    """A working cache of its own holding the first ``n_tokens`` of ``cache`` (which is
    left as it was: writes to either never reach the other)."""
    if n_tokens == 0:
        return [KVCache() for _ in cache]
    return working_cache(len(cache),
                         lambda i: _with_room(_filled(cache[i]), n_tokens),
                         n_tokens)


def _with_room(layer: tuple[mx.array, mx.array], n_tokens: int) -> tuple[mx.array, mx.array]:
    keys, values = layer
    return with_room(keys, n_tokens), with_room(values, n_tokens)


def cache_nbytes(cache: list[KVCache]) -> int:
    """Memory a float working cache holds (its allocated buffers)."""
    return sum(keys.nbytes + values.nbytes for keys, values in ((layer.keys, layer.values) for layer in cache)
               if keys is not None and values is not None)
