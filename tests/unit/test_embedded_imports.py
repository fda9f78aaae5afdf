"""Imports of an embedded model: one at a time, each in a scratch directory of its own."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from app.catalog import gguf_import, registry

NAME = "smollm2-135m-instruct"


def test_two_processes_importing_one_model_at_once_make_one_import(tmp_path: Path, monkeypatch) -> None:
    """A second importer (a server and a `semantic models` command, two test runs) waits for
    the first and takes its import: without the lock both import, and the second replaces the
    directory the first returned."""
    imports, scratches = [], []

    def locate(model: object, scratch: Path) -> Path:
        scratches.append(scratch)
        (scratch / "model.gguf").write_bytes(b"GGUF")
        return scratch / "model.gguf"

    def import_one(source: Path, destination: Path, progress: bool = True) -> None:
        assert source.exists()  # no other import removed this one's scratch
        imports.append(source)
        time.sleep(0.3)
        destination.mkdir()
        (destination / "config.json").write_text("{}")

    monkeypatch.setattr(registry, "locate_gguf", locate)
    monkeypatch.setattr(gguf_import, "import_gguf", import_one)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(registry.ensure_embedded(tmp_path, NAME,
                                                                                       progress=False)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / NAME] * 2
    assert len(imports) == 1
    assert not any(scratch.exists() for scratch in scratches)
