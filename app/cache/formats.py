"""The stored KV formats (``KVFormat``, ``KV_FORMATS``): values, no MLX.

What each format keeps, how many bytes it stores, its fingerprint and which heads it
can store; the quantization itself (MLX's affine quantization, the Hadamard rotation)
is ``blocks.py``'s, which the module docstring there describes format by format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.cache.hashing import BLOCK_TOKENS
from app.types import KV_FORMAT_NAMES

if TYPE_CHECKING:
    import mlx.core as mx

TIME_GROUP = 64  # per-channel keys: tokens per quantization group along time (blocks of 256 hold 4)
HEAD_GROUPS = (64, 32)  # values per group along a head, preferred first (MLX's affine groups are 32, 64 or 128)
RESIDUAL_TOKENS = 64  # per-channel keys: the newest keys kept float16 (see KVFormat.grouped_tokens)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Bits of the stored keys and values, which are rotated first, whether keys are
    quantized per channel (over groups of 64 tokens) rather than per token, and how many
    values along a head share a scale (``group_size``: set per model by ``for_head_dim``)."""

    name: str
    key_bits: int
    value_bits: int
    rotate_keys: bool = False
    rotate_values: bool = False
    channel_keys: bool = False
    group_size: int = HEAD_GROUPS[0]

    @property
    def quantized(self) -> bool:
        return self.key_bits < 16

    @property
    def float_dtype(self) -> mx.Dtype:
        """What an unquantized format stores (``f16``, ``f32``): the one use of MLX here,
        imported when asked (by the array work in ``blocks.py``)."""
        import mlx.core as mx

        return mx.float32 if self.key_bits == 32 else mx.float16

    @property
    def fingerprint(self) -> str:
        """Part of every model fingerprint: caches of another format never match."""
        if not self.quantized:
            return f"float{self.key_bits}-b{BLOCK_TOKENS}"
        bits = f"q{self.key_bits}" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        if self.rotate_keys and self.rotate_values and not self.channel_keys:
            layout = "-hadamard"  # keys and values (q4r's string before formats rotated only one)
        else:
            layout = ("-kchannel" if self.channel_keys else "-khadamard" if self.rotate_keys else "") + \
                ("-vhadamard" if self.rotate_values else "")
        return f"affine-{bits}{layout}-g{self.group_size}-s16-b{BLOCK_TOKENS}"

    @property
    def bytes_per_value(self) -> float:
        """Mean stored bytes per key or value element (data, then a float16 scale and bias per group)."""
        if not self.quantized:
            return self.key_bits / 8
        key_group = TIME_GROUP if self.channel_keys else self.group_size
        return ((self.key_bits + 32 / key_group) + (self.value_bits + 32 / self.group_size)) / 2 / 8

    @property
    def bytes_vs_fp16(self) -> float:
        """Stored bytes relative to float16 keys and values."""
        return self.bytes_per_value / 2

    def unfit_reason(self, head_dim: int) -> str | None:
        """Why this format (with its ``group_size``) cannot store heads of ``head_dim``
        values, in one line, or None if it can."""
        if not self.quantized:
            return None
        if not any(head_dim % group == 0 for group in HEAD_GROUPS):
            return (f"kv_format {self.name} quantizes in groups of {' or '.join(map(str, HEAD_GROUPS))} values "
                    f"along each head and neither divides head_dim {head_dim} (f16 and f32 store any head_dim)")
        if head_dim % self.group_size:
            return f"kv_format {self.name} in groups of {self.group_size} values cannot store head_dim {head_dim}"
        if (self.rotate_keys or self.rotate_values) and not rotation_is_exact(head_dim):
            return (f"kv_format {self.name} rotates by MLX's Hadamard transform, its own inverse only for "
                    f"2^k or 12*2^k values, not head_dim {head_dim} (q8, f16 and f32 do not rotate)")
        return None

    def for_head_dim(self, head_dim: int) -> KVFormat:
        """This format for a model whose heads hold ``head_dim`` values: groups of 64 along
        the head where 64 divides it (the fingerprint of every format on such heads is
        unchanged), else of 32 (another fingerprint).

        Raises:
            ValueError: the format cannot store such heads (``unfit_reason``).
        """
        group = next((g for g in HEAD_GROUPS if head_dim % g == 0), self.group_size)
        fitted = dataclasses.replace(self, group_size=group) if self.quantized else self
        reason = fitted.unfit_reason(head_dim)
        if reason is not None:
            raise ValueError(reason)
        return fitted

    def grouped_tokens(self, n_tokens: int) -> int:
        """How many of a stored conversation's ``n_tokens`` tokens have their keys in
        quantized groups: per token, all; per channel, every complete group but the
        newest keys (the last 64 to 127 tokens stay float16), so that the next turn,
        which re-renders the end of the reply, does not diverge inside a quantized group."""
        if not self.channel_keys:
            return n_tokens
        return max(0, n_tokens - RESIDUAL_TOKENS) // TIME_GROUP * TIME_GROUP

    def reusable(self, n_reused: int, n_grouped: int) -> int:
        """How many of a stored cache's first ``n_reused`` tokens a lease may reuse, when
        its first ``n_grouped`` tokens have quantized keys. Per-channel keys: a cut inside
        those groups goes back to the group's start (its tokens hold dequantized 4-bit
        data, which the next commit would quantize again); a cut in the float16 keys is kept."""
        if not self.channel_keys or n_reused >= n_grouped:
            return n_reused
        return n_reused - n_reused % TIME_GROUP


def rotation_is_exact(n: int) -> bool:
    """Whether MLX's normalized Hadamard transform of ``n`` values is its own inverse, as
    the rotation needs: for n = 2^k and 12 * 2^k. For 20 * 2^k and 28 * 2^k (80, 160, 112)
    its matrix is orthogonal but not symmetric, and other sizes are unsupported (there it
    can corrupt memory rather than raise), so the rule is stated, never probed."""
    odd = n
    while odd % 2 == 0:
        odd //= 2
    return n > 0 and (odd == 1 or (odd == 3 and n % 12 == 0))


# Every stored format, smallest first (docs/kv-formats.md has what each keeps on both real models).
KV_FORMATS = {f.name: f for f in (
    KVFormat("q4r", 4, 4, rotate_keys=True, rotate_values=True),
    KVFormat("q4c", 4, 4, rotate_values=True, channel_keys=True),
    KVFormat("k5c", 5, 4, rotate_values=True, channel_keys=True),
    KVFormat("k6v4", 6, 4, rotate_keys=True, rotate_values=True),
    KVFormat("k8v4", 8, 4, rotate_values=True),
    KVFormat("q8", 8, 8),
    KVFormat("f16", 16, 16),
    KVFormat("f32", 32, 32))}
assert tuple(KV_FORMATS) == KV_FORMAT_NAMES
# The format of callers that name none (tests of one layer); the server resolves one per
# model (kv_format "auto": app/engine/calibration.py).
DEFAULT_KV_FORMAT = KV_FORMATS["q4c"]

assert BLOCK_TOKENS % TIME_GROUP == 0  # per-channel key groups never cross a block boundary
