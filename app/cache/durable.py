"""Files that survive a power cut: what must be on disk before an index row may point at a
file. A file's data, its name in its directory and every directory made on the way are
each fsynced (tests/e2e/test_power_loss.py rebuilds a home from its fsyncs alone)."""

from __future__ import annotations

import os
from pathlib import Path


def sync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def make_directories(directory: Path) -> None:
    """``mkdir -p`` whose new directories are each synced into their parent."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)  # another thread may be making it too: it syncs, and so do we
        sync_directory(new.parent)


def install(temporary: Path, path: Path) -> None:
    """Move the fully written ``temporary`` to ``path`` (its directory made as needed) so
    that both its content and its name are on disk when this returns."""
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    make_directories(path.parent)
    os.replace(temporary, path)
    sync_directory(path.parent)
