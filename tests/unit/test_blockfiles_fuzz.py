"""Cache files, damaged every way a disk or a crash can damage them: reading one either gives
back exactly what was written or says it is damaged. Never another exception (a 5xx), never
other data (a wrong answer)."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cache import files as blockfiles

ARRAYS = {"0.k_w": np.arange(64, dtype=np.uint32).reshape(1, 1, 4, 16),
          "0.k_s": np.linspace(0, 1, 4, dtype=np.float16).reshape(1, 1, 4, 1)}
META = {"fingerprint": "fp", "hash": "ab" * 32, "n_tokens": "4", "text": "héllo"}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "block.safetensors"
    blockfiles.write(path, ARRAYS, META)
    return path.read_bytes()


def check(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(data)
    try:
        arrays, meta = blockfiles.read(path)
    except blockfiles.DamagedFile:
        return
    assert meta == META and arrays.keys() == ARRAYS.keys()
    assert all(np.array_equal(arrays[k], ARRAYS[k]) and arrays[k].dtype == ARRAYS[k].dtype for k in ARRAYS)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_a_flipped_bit(tmp_path: Path, original: bytes, position: int, bit: int) -> None:
    data = bytearray(original)
    data[position % len(data)] ^= 1 << bit
    check(tmp_path, bytes(data))


@FUZZ
@given(length=st.integers(min_value=0))
def test_a_truncated_file(tmp_path: Path, original: bytes, length: int) -> None:
    check(tmp_path, original[:length % len(original)])


@FUZZ
@given(header_length=st.integers(min_value=0, max_value=2**64 - 1))
def test_a_garbage_header_length(tmp_path: Path, original: bytes, header_length: int) -> None:
    check(tmp_path, struct.pack("<Q", header_length) + original[8:])


@FUZZ
@given(header=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_a_garbage_header(tmp_path: Path, original: bytes, header: bytes) -> None:
    check(tmp_path, struct.pack("<Q", len(header)) + header + original[8 + struct.unpack("<Q", original[:8])[0]:])


@pytest.mark.parametrize("header", [b'{"__metadata__": [1, 2]}', b'[1, 2, 3]', b'{"__metadata__": {"sha256": 5}}',
                                    b'{"x": {"dtype": "F32", "shape": [99999999999], "data_offsets": [0, 4]}}'])
def test_headers_of_the_wrong_shape(tmp_path: Path, original: bytes, header: bytes) -> None:
    check(tmp_path, struct.pack("<Q", len(header)) + header + b"\0" * 16)


def test_a_file_that_shrinks_while_it_is_read(tmp_path: Path, original: bytes,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer a file is read into is not cleared first: bytes the read did not fill are
    never parsed, whatever they hold (the file is damaged)."""
    path = tmp_path / "block.safetensors"
    path.write_bytes(original)
    real_fstat = blockfiles.os.fstat

    def larger(fd: int) -> object:  # the size seen before a writer truncated it
        status = real_fstat(fd)
        return type("Status", (), {"st_size": status.st_size + 4096})()

    monkeypatch.setattr(blockfiles.os, "fstat", larger)
    with pytest.raises(blockfiles.DamagedFile, match="shorter than its size"):
        blockfiles.read(path)
    monkeypatch.undo()
    assert blockfiles.read(path)[1] == META


def test_a_record_holds_lists_of_integers() -> None:
    """A record's token ids and char ends come back as Python ints; any other array (a forged
    record of the right checksum) is a ValueError, which makes its cache a miss."""
    got = blockfiles._integers(np.array([3, 1, 2], dtype=np.int64))
    assert got == (3, 1, 2) and all(type(t) is int for t in got)
    for bad in (np.zeros((2, 2), dtype=np.int64), np.array([1.5, 2.0]), np.array([True])):
        with pytest.raises(ValueError, match="not integers"):
            blockfiles._integers(bad)


def test_a_thread_reads_block_files_into_one_buffer(tmp_path: Path) -> None:
    """``reuse``: a thread's reads share one buffer (a restore faults in no fresh memory for
    its files), so the arrays of one read hold the next one's bytes: whoever keeps them
    copies them first (``CacheFiles.read_block``'s ``convert``). Without ``reuse`` each read
    has a buffer of its own."""
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    blockfiles.write(first, ARRAYS, META)
    blockfiles.write(second, {name: array + 1 for name, array in ARRAYS.items()}, META)
    read_first, _ = blockfiles.read(first, reuse=True)
    kept = {name: array.copy() for name, array in read_first.items()}
    read_second, _ = blockfiles.read(second, reuse=True)
    assert read_second["0.k_w"].ctypes.data == read_first["0.k_w"].ctypes.data
    assert np.array_equal(read_first["0.k_w"], ARRAYS["0.k_w"] + 1)  # overwritten by the second read
    assert all(np.array_equal(kept[name], ARRAYS[name]) for name in ARRAYS)
    own, _ = blockfiles.read(first)
    assert own["0.k_w"].ctypes.data != read_second["0.k_w"].ctypes.data
    assert np.array_equal(own["0.k_w"], ARRAYS["0.k_w"]) and np.array_equal(read_second["0.k_w"], ARRAYS["0.k_w"] + 1)
    with ThreadPoolExecutor(1) as pool:  # another thread: another buffer
        other = pool.submit(lambda: blockfiles.read(first, reuse=True)[0]["0.k_w"].ctypes.data).result()
    assert other != read_second["0.k_w"].ctypes.data
