"""An agent archive is read a chunk at a time onto the home's disk, never whole into memory
(round 4, item 10: before, every member was held in memory at once, so an archive's size
was the import's memory), and what does not fit is refused before it is copied."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from app.agents import portable
from app.errors import InvalidRequest

MEMBER_BYTES = 48 << 20


def _archive(tmp_path: Path, names: list[str]) -> Path:
    """A tar of agent.json and ``names``, each ``MEMBER_BYTES`` of one repeated byte,
    written from disk (so building it holds no member in memory either)."""
    blob = tmp_path / "blob"
    with open(blob, "wb") as out:
        for _ in range(MEMBER_BYTES >> 20):
            out.write(b"\x07" * (1 << 20))
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    manifest = {"format": portable.FORMAT, "version": portable.VERSION, "agent": {"id": "a"}, "conversations": [],
                "files": {name: digest for name in names}}
    path = tmp_path / "agent.tar"
    with tarfile.open(path, "w") as archive:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(portable.MANIFEST)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
        for name in names:
            archive.add(blob, arcname=name)
    blob.unlink()
    return path


def test_members_are_copied_to_the_spool_a_chunk_at_a_time(tmp_path: Path) -> None:
    path = _archive(tmp_path, ["blocks/a.safetensors", "records/r.safetensors"])
    spool = tmp_path / "spool"
    spool.mkdir()
    tracemalloc.start()
    try:
        with open(path, "rb") as source:
            manifest, members = portable._read_archive(source, spool)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(members) == {"blocks/a.safetensors", "records/r.safetensors"}
    for copied in members.values():
        assert copied.parent == spool and copied.stat().st_size == MEMBER_BYTES
    assert manifest["agent"] == {"id": "a"}
    # Two 48 MiB members; the reader held a few chunks at most (before: both, 96 MiB, and
    # each read asked for its limit, 512 MiB, up front).
    assert peak < 8 * portable.SPOOL_CHUNK_BYTES, peak


def test_a_member_the_home_has_no_room_for_is_refused_before_it_is_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _archive(tmp_path, ["blocks/a.safetensors"])
    spool = tmp_path / "spool"
    spool.mkdir()
    full = shutil.disk_usage(spool)._replace(free=MEMBER_BYTES)  # the member fits, the margin does not
    monkeypatch.setattr(portable.shutil, "disk_usage", lambda _: full)
    with open(path, "rb") as source, pytest.raises(InvalidRequest, match="no room in the home"):
        portable._read_archive(source, spool)
    assert list(spool.iterdir()) == []


def test_an_archive_naming_a_member_twice_is_refused(tmp_path: Path) -> None:
    path = _archive(tmp_path, ["blocks/a.safetensors", "blocks/a.safetensors"])
    spool = tmp_path / "spool"
    spool.mkdir()
    with open(path, "rb") as source, pytest.raises(InvalidRequest, match="appears twice"):
        portable._read_archive(source, spool)


def test_an_import_leaves_no_spool_behind(tmp_path: Path) -> None:
    """Refused (here: an archive of no agent), the import removes its spool with its files."""
    from app.store.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    root = tmp_path / "blocks"
    path = _archive(tmp_path, ["blocks/a.safetensors"])
    with open(path, "rb") as source, pytest.raises(InvalidRequest):
        portable.import_agent(make_session_factory(make_engine(url)), root, source)
    assert list(root.iterdir()) == []
