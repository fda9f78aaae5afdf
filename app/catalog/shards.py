"""Sharded safetensors output written one tensor at a time.

The ``safetensors`` package serializes a whole dict of arrays held in memory;
an import that dequantizes a multi-GB GGUF file would then hold every tensor
at once. The format is a little-endian u64 header length, a JSON header
(dtype, shape and byte range of each tensor) and the raw bytes, so when every
shape and dtype is known before any tensor is converted (GGUF metadata says
them), each shard's header can be written first and its tensors streamed
after it: memory holds one source tensor and its outputs, never a shard.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

# safetensors dtype tags by the numpy dtype that carries the bytes (bfloat16
# travels as uint16 holding the upper half of a float32).
ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}
CARRIER = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "U32": np.dtype("<u4")}


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One output tensor: its name, safetensors dtype tag and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEM_BYTES[self.dtype]


@dataclass(slots=True)
class Shard:
    """Output tensors of some source tensors, in write order, grouped per source."""

    groups: list[tuple[int, list[PlannedTensor]]] = field(default_factory=list)  # (source index, its outputs)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, outputs in self.groups for t in outputs)

    def header(self) -> bytes:
        entries: dict[str, object] = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for _, outputs in self.groups:
            for tensor in outputs:
                entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                        "data_offsets": [offset, offset + tensor.nbytes]}
                offset += tensor.nbytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(text)) + text


def plan_shards(groups: list[tuple[int, list[PlannedTensor]]], max_shard_bytes: int) -> list[Shard]:
    """Cut the groups, in order, into shards of at most ``max_shard_bytes``.

    A source tensor's outputs stay in one shard; one larger than the limit gets
    a shard of its own.
    """
    shards: list[Shard] = [Shard()]
    for group in groups:
        size = sum(t.nbytes for t in group[1])
        if shards[-1].groups and shards[-1].nbytes + size > max_shard_bytes:
            shards.append(Shard())
        shards[-1].groups.append(group)
    return shards


def shard_names(n_shards: int) -> list[str]:
    """File names mlx-lm (``model*.safetensors``) and Hugging Face both read."""
    if n_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]


def write_tensor(handle: BinaryIO, planned: PlannedTensor, array: np.ndarray) -> None:
    """Append ``array``'s bytes after checking they are the planned ones."""
    if array.shape != planned.shape or array.dtype != CARRIER[planned.dtype]:
        raise ValueError(f"{planned.name}: produced {array.dtype}{array.shape}, "
                         f"planned {planned.dtype}{planned.shape}")
    handle.write(np.ascontiguousarray(array).data)


def write_index(directory: Path, shards: list[Shard], names: list[str]) -> None:
    weight_map = {t.name: file for shard, file in zip(shards, names) for _, outputs in shard.groups for t in outputs}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def iter_shard_files(directory: Path, shards: list[Shard]) -> Iterator[tuple[Shard, BinaryIO]]:
    """Open each shard's file in turn with its header written; closed after use."""
    for shard, name in zip(shards, shard_names(len(shards))):
        with (directory / name).open("wb") as handle:
            handle.write(shard.header())
            yield shard, handle
