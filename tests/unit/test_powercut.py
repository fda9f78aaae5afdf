"""The power-cut model itself (tests/support/powercut): after the cut, a file holds what
was last fsynced of it, and exists only if its name was fsynced in its directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import powercut

WRITER = """
import os, sys
root = sys.argv[1]
def sync_dir(path):
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
def write(name, data, sync):
    with open(os.path.join(root, name), "w") as f:
        f.write(data); f.flush()
        if sync: os.fsync(f.fileno())
write("kept", "kept", True)
write("dataless", "lost", False)
sync_dir(root)
write("unnamed", "lost", True)
os.mkdir(os.path.join(root, "sub"))
write("sub/file", "lost", True)
sync_dir(os.path.join(root, "sub"))
with open(os.path.join(root, "old"), "a") as f:
    f.write(", appended")
"""


def test_only_what_was_fsynced_survives(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "old").write_text("from before")
    cut = powercut.Cut(root, tmp_path / "cut", powercut.build(tmp_path / "shim"))
    subprocess.run([sys.executable, "-c", WRITER, str(root)], env={**os.environ, **cut.env()}, check=True)
    assert (root / "old").read_text() == "from before, appended" and (root / "unnamed").exists()
    assert cut.rebuild() == 5
    assert (root / "kept").read_text() == "kept"
    assert (root / "dataless").read_text() == ""  # its name was synced, its data never
    assert not (root / "unnamed").exists()  # synced data, but created after the directory's last sync
    assert not (root / "sub").exists()  # a new directory is lost with all it holds until its parent syncs
    assert (root / "old").read_text() == "from before"  # the unsynced append is gone
