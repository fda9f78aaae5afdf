"""Hostile GGUF headers are a one-line InvalidModelFile, never a traceback or a hang."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from app.catalog.gguf_import import GgufFile
from app.errors import InvalidModelFile


def _gguf(path: Path, n_tensors: int, n_kv: int, rest: bytes = b"") -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + rest + bytes(64))
    return path


@pytest.mark.parametrize("n_tensors, n_kv", [(1 << 40, 0), (0, 1 << 40), (1 << 63, 1 << 63)])
def test_counts_the_file_cannot_hold_are_refused_before_reading(tmp_path: Path, n_tensors: int, n_kv: int) -> None:
    with pytest.raises(InvalidModelFile, match="the header claims .* more than a 88-byte file holds"):
        GgufFile(_gguf(tmp_path / "x.gguf", n_tensors, n_kv))


def test_a_key_longer_than_the_file_is_refused(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "x.gguf", 0, 1, struct.pack("<Q", 1 << 62) + b"general.architecture")
    with pytest.raises(InvalidModelFile, match="not a readable GGUF file"):
        GgufFile(path)


def test_not_gguf_at_all(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(InvalidModelFile, match="no GGUF magic"):
        GgufFile(tmp_path / "x.gguf")
