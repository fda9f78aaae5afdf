"""Cache files carry a BLAKE3 checksum, and the files an older server wrote (a sha256) still
verify and restore: an upgrade never turns a stored conversation into a miss, and never adopts
a file that does not hold what its index row says."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

from app.agents.portable import export_agent, import_agent
from app.cache import files
from app.cache.hashing import BLOCK_TOKENS
from app.cache.records import CacheRecord
from app.store.db import make_engine, make_session_factory
from support.dbcheck import query
from test_cache_poisoning import FINGERPRINT, _turn
from test_cache_round_trips import VOCAB, _record_fields, as_prompt, build, forward, manager, store_turn

ARRAYS = {"0.k_w": np.arange(64, dtype=np.uint32).reshape(1, 1, 4, 16),
          "0.k_s": np.linspace(0, 1, 4, dtype=np.float16).reshape(1, 1, 4, 1)}
META = {"fingerprint": "fp", "hash": "ab" * 32, "n_tokens": "4"}


def sha256_of(arrays: files.Arrays, metadata: dict[str, str]) -> str:
    """The checksum files written before BLAKE3 carry, as they defined it (frozen here: those
    files are on disks and must keep verifying)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    return digest.hexdigest()


def write_legacy(path: Path, arrays: files.Arrays, metadata: dict[str, str]) -> str:
    """A file as a server before BLAKE3 wrote it; returns its checksum."""
    digest = sha256_of(arrays, metadata)
    save_file(arrays, str(path), metadata={**metadata, "sha256": digest})
    return digest


def test_a_file_written_now_carries_a_blake3_checksum_that_fits_the_index(tmp_path: Path) -> None:
    path = tmp_path / "block.safetensors"
    digest, _ = files.write(path, ARRAYS, META)
    assert digest.startswith("blake3:") and len(digest) <= 64  # the index's checksum columns hold 64
    assert files.read_metadata(path) == {**META, "checksum": digest}
    assert files.claimed_checksum(path) == digest != sha256_of(ARRAYS, META)
    arrays, meta, verified = files.read_verified(path, digest)
    assert meta == META and verified == digest and all(np.array_equal(arrays[k], ARRAYS[k]) for k in ARRAYS)


def test_a_file_written_now_is_a_safetensors_file_that_safetensors_reads(tmp_path: Path) -> None:
    path = tmp_path / "block.safetensors"
    digest, size = files.write(path, ARRAYS, META)
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    assert loaded.keys() == ARRAYS.keys() and all(np.array_equal(loaded[k], ARRAYS[k]) for k in ARRAYS)
    with safe_open(str(path), "numpy") as handle:
        assert handle.metadata() == {**META, "checksum": digest}


def test_arrays_swapped_in_the_header_are_damage(tmp_path: Path) -> None:
    """The checksum covers where each array lies, not only the bytes: two arrays of one size
    whose places in the header are swapped (their bytes untouched) fail it."""
    path = tmp_path / "block.safetensors"
    same = {"0.v_s": np.zeros((1, 1, 4, 1), np.float16), "0.v_b": np.ones((1, 1, 4, 1), np.float16)}
    files.write(path, same, META)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["0.v_s"]["data_offsets"], header["0.v_b"]["data_offsets"] = \
        header["0.v_b"]["data_offsets"], header["0.v_s"]["data_offsets"]
    swapped = json.dumps(header, separators=(",", ":")).encode()
    swapped += b" " * (n - len(swapped))
    assert len(swapped) == n
    path.write_bytes(data[:8] + swapped + data[8 + n:])
    with pytest.raises(files.DamagedFile, match="checksum mismatch"):
        files.read(path)


def test_a_file_written_before_blake3_still_verifies_and_its_damage_is_found(tmp_path: Path) -> None:
    path = tmp_path / "old.safetensors"
    digest = write_legacy(path, ARRAYS, META)
    arrays, meta, verified = files.read_verified(path, digest)
    assert (meta, verified) == (META, digest)
    assert all(np.array_equal(arrays[k], ARRAYS[k]) for k in ARRAYS)
    assert files.claimed_checksum(path) == digest
    with pytest.raises(files.DamagedFile):  # the index row names another file's checksum
        files.read(path, "0" * 64)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # a flipped bit in the last array's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(files.DamagedFile, match="checksum mismatch"):
        files.read(path)


def test_a_file_without_a_checksum_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "bare.safetensors"
    save_file(ARRAYS, str(path), metadata=META)
    with pytest.raises(files.DamagedFile, match="no checksum"):
        files.read(path)


def _convert_home(home: Path) -> int:
    """Rewrite every cache file of ``home`` as a server before BLAKE3 wrote it, and its index
    rows' checksums with it; returns how many files."""
    converted = 0
    for path in sorted((home / "blocks").rglob("*.safetensors")):
        arrays, meta, digest = files.read_verified(path)
        arrays = {name: np.array(a) for name, a in arrays.items()}  # out of the buffer the file is read into
        legacy = write_legacy(path, arrays, meta)
        with sqlite3.connect(home / "semantic.db") as db:
            for table, column in (("blocks", "checksum"), ("caches", "record_checksum")):
                db.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (legacy, digest))
        converted += 1
    return converted


def test_a_home_written_before_blake3_restores_as_it_was_and_keeps_its_files(tmp_path: Path) -> None:
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, VOCAB, 2 * BLOCK_TOKENS + 60).tolist()
    more = rng.integers(0, VOCAB, 20).tolist()
    caches = manager(tmp_path, n_layers)
    store_turn(caches, model, "a-c", tokens)
    assert caches.flush(60)
    caches.close()

    upgraded = manager(tmp_path, n_layers)  # the files as this version wrote them
    lease = upgraded.lease("a", "a-c", as_prompt(tokens + more))
    assert lease.n_reused == len(tokens)
    expected = forward(model, lease.cache, more)
    upgraded.close()

    rows = query(tmp_path / "semantic.db", "SELECT checksum FROM blocks")
    assert rows and _convert_home(tmp_path) == len(rows) + 1  # the full blocks and the record
    rows = query(tmp_path / "semantic.db", "SELECT checksum FROM blocks")
    assert all(len(c) == 64 and not c.startswith("blake3:") for (c,) in rows)
    old_files = {p: p.read_bytes() for p in (tmp_path / "blocks").rglob("*.safetensors")}

    restarted = manager(tmp_path, n_layers)
    lease = restarted.lease("a", "a-c", as_prompt(tokens + more))
    assert (lease.n_reused, lease.report.reason) == (len(tokens), "extend")
    assert mx.array_equal(forward(model, lease.cache, more), expected)
    # Another conversation starting with the same blocks shares them: each old file is kept
    # (its index row claims it), not rewritten.
    shared = tokens[:len(rows) * BLOCK_TOKENS] + more
    other = restarted.lease("b", "b-c", as_prompt(shared))
    assert (other.n_reused, other.report.reason) == (len(rows) * BLOCK_TOKENS, "shared")
    forward(model, other.cache, more)
    restarted.commit(other, CacheRecord(*_record_fields(shared)), other.cache)
    assert restarted.flush(60)
    restarted.close()
    for path, data in old_files.items():
        if "conversations" not in path.parts:
            assert path.read_bytes() == data, path


def test_an_old_file_at_a_block_address_is_adopted_only_if_it_holds_the_blocks_data(tmp_path: Path) -> None:
    layout = files.CacheFiles(tmp_path, "f" * 64)
    block = "cd" * 32

    class Data:
        n_tokens = 4

        def __init__(self, arrays: files.Arrays) -> None:
            self.arrays = arrays

        def to_numpy(self, prefix: str = "") -> files.Arrays:
            return self.arrays

    meta = {"fingerprint": layout.fingerprint, "hash": block, "n_tokens": "4"}
    path = layout.block_path(block)
    path.parent.mkdir(parents=True)
    legacy = write_legacy(path, ARRAYS, meta)
    assert layout.write_block(block, Data(ARRAYS)) == (path, legacy)  # exactly the data: kept as it is
    assert files.read_metadata(path).get("sha256") == legacy

    other = {name: a + 1 for name, a in ARRAYS.items()}
    written, digest = layout.write_block(block, Data(other))  # another block's data: replaced
    assert written == path and digest.startswith("blake3:")
    arrays, _ = files.read(path, digest)
    assert all(np.array_equal(arrays[k], other[k]) for k in other)


def test_an_archives_blocks_equal_to_a_homes_old_files_are_taken_as_that_homes_own(tmp_path: Path) -> None:
    """An import finds this home's own blocks by their index rows' checksums (an archive's block
    equal to one is public, not a private copy), old rows' sha256 included."""
    model = build("llama")
    n_layers = len(model.layers)
    tokens = np.random.default_rng(5).integers(0, VOCAB, 600).tolist()  # two full blocks and a tail
    source = manager(tmp_path / "source", n_layers, FINGERPRINT, agents=("a",))
    _turn(source, model, "a", "c", tokens)
    source.close()
    archive = tmp_path / "a.tar"
    with open(archive, "wb") as out:
        export_agent(make_session_factory(make_engine(f"sqlite:///{tmp_path / 'source' / 'semantic.db'}")),
                     tmp_path / "source" / "blocks", "a", out)

    home = tmp_path / "home"
    caches = manager(home, n_layers, FINGERPRINT, agents=("h",))
    _turn(caches, model, "h", "honest", tokens)  # the same start, computed here before BLAKE3
    caches.close()
    assert _convert_home(home) == 3
    with open(archive, "rb") as source_file:
        imported = import_agent(make_session_factory(make_engine(f"sqlite:///{home / 'semantic.db'}")),
                                home / "blocks", source_file, "copy")
    assert (imported.n_blocks_new, imported.n_cached_tokens) == (0, 600)


@pytest.mark.parametrize("layout", ["stacked", "one array a layer", "sha256"])
def test_a_block_read_before_its_checksum_is_verified_where_its_data_was_copied(tmp_path: Path, layout: str) -> None:
    """A restore reads a block file into MLX arrays and checks its checksum while it
    dequantizes them (``files.Unverified``): the check hashes the MLX arrays the data was
    copied into, in the file's layout, and finds what a read that verifies finds: a block that
    verifies equals the one written, and a flipped bit in the file, a changed array after the
    copy, or an index row that names another checksum is damage."""
    from app.cache.blocks import KVBlock, quantize_span
    from app.cache.formats import KV_FORMATS
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(5)
    n_layers, n_tokens, fingerprint, block = 3, BLOCK_TOKENS, "f" * 64, "ab" * 32
    cache = [KVCache() for _ in range(n_layers)]
    for layer in cache:
        layer.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, n_tokens, 64)), dtype=mx.float32)
                                 for _ in range(2)))
    written = quantize_span(cache, 0, n_tokens, KV_FORMATS["q8"])
    store = files.CacheFiles(tmp_path, fingerprint)
    path, digest = store.write_block(block, written)
    if layout != "stacked":  # as a server before stacking, or before BLAKE3, wrote it
        arrays = written.to_arrays() if layout == "one array a layer" else written.to_numpy()
        arrays = {name: np.array(a) for name, a in arrays.items()}
        meta = {"fingerprint": fingerprint, "hash": block, "n_tokens": str(n_tokens)}
        digest = write_legacy(path, arrays, meta) if layout == "sha256" else files.write(path, arrays, meta)[0]
    assert files.read_metadata(path).keys() >= {"sha256" if layout == "sha256" else "checksum"}

    def convert(arrays: files.Arrays) -> KVBlock:
        return KVBlock.from_numpy(arrays, n_layers, n_tokens)

    read = store.read_block_unverified(block, path, digest, convert)
    verified = files.verify_all([read])[0]
    assert verified is read.data and all(mx.array_equal(a, b) for mine, theirs in zip(verified.layers, written.layers)
                                         for a, b in zip(mine, theirs))
    with pytest.raises(files.DamagedFile, match="checksum mismatch"):  # the index row names another file
        store.read_block_unverified(block, path, "blake3:" + "0" * 56, convert).verify()

    changed = store.read_block_unverified(block, path, digest, convert)
    np.array(changed.data.layers[-1][-1], copy=False).reshape(-1)[-1] += np.float16(1)  # after the copy
    with pytest.raises(files.DamagedFile, match="checksum mismatch"):
        changed.verify()

    data = bytearray(path.read_bytes())
    data[-5] ^= 1  # a flipped bit in the file's last array
    path.write_bytes(bytes(data))
    flipped = store.read_block_unverified(block, path, digest, convert)  # read: not verified yet
    with pytest.raises(files.DamagedFile, match="checksum mismatch"):
        files.verify_all([read, flipped])
