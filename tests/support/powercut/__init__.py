"""A simulated power cut: what a directory holds after the machine stops, if only what a
process fsynced reached the disk.

``powercut.c`` (LD_PRELOAD) journals every successful fsync/fdatasync under a root: a
file's content at that moment, a directory's entries at that moment. ``Cut`` takes the
root's state before the process starts (the baseline: files a clean shutdown left, long
since on disk), and after the process is killed, ``rebuild`` replaces the root with the
baseline plus the journal: every directory as its last synced listing said (else as at
the baseline), every file as its last synced content (else as at the baseline, else
empty). Writes that were never synced are gone, as after a real cut on a disk that
honours fsync and promises nothing more.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("powercut.c")


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # f(ile) / d(irectory) / l(ink)
    inode: int
    target: str = ""  # a link's


def build(workdir: Path) -> Path:
    """Compile the shim (gcc; the test scripts install it)."""
    library = workdir / "powercut.so"
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library), str(SOURCE),
                    "-ldl", "-lpthread"], check=True)
    return library


def _listing(directory: Path) -> list[Entry]:
    entries = []
    for child in sorted(os.scandir(directory), key=lambda e: e.name):
        stat = child.stat(follow_symlinks=False)
        if child.is_symlink():
            entries.append(Entry(child.name, "l", stat.st_ino, os.readlink(child.path)))
        else:
            entries.append(Entry(child.name, "d" if child.is_dir(follow_symlinks=False) else "f", stat.st_ino))
    return entries


@dataclass
class Cut:
    """One simulated cut of ``root``, journaled under ``workdir``."""

    root: Path
    workdir: Path
    library: Path
    dirs: dict[str, list[Entry]] = field(default_factory=dict)  # "." / relative path -> entries
    contents: dict[int, Path] = field(default_factory=dict)  # inode -> a file with its durable content

    def __post_init__(self) -> None:
        """Take the baseline: the root as it is now counts as on disk."""
        self.root = self.root.resolve()
        baseline = self.workdir / "baseline"
        shutil.copytree(self.root, baseline, symlinks=True)
        (self.workdir / "journal").mkdir(parents=True)
        (self.workdir / "journal" / "data").mkdir()
        for directory, _, _ in os.walk(self.root):
            relative = os.path.relpath(directory, self.root)
            self.dirs[relative] = _listing(Path(directory))
            for entry in self.dirs[relative]:
                if entry.kind == "f":
                    self.contents[entry.inode] = baseline / relative / entry.name

    def env(self) -> dict[str, str]:
        """The environment that puts a process under the shim."""
        return {"LD_PRELOAD": str(self.library), "POWERCUT_ROOT": str(self.root),
                "POWERCUT_LOG": str(self.workdir / "journal")}

    def rebuild(self) -> int:
        """After the process is dead: replace the root with what the disk would hold. Returns
        how many syncs the journal recorded."""
        journal = self.workdir / "journal"
        lines = (journal / "journal").read_text().splitlines() if (journal / "journal").exists() else []
        dirs, contents, syncs = dict(self.dirs), dict(self.contents), 0
        listing: list[Entry] | None = None
        for line in lines:
            tag, _, rest = line.partition(" ")
            if tag == "!":
                raise AssertionError(f"the process called {rest}(), which the model cannot follow")
            if tag == "F":
                inode, name = rest.split(" ")
                contents[int(inode)] = journal / "data" / name
                syncs += 1
            elif tag == "D":
                listing = dirs[os.path.relpath(rest, self.root)] = []
                syncs += 1
            elif tag == "E" and listing is not None:
                kind, inode, name = rest.split(" ", 2)
                listing.append(Entry(name, kind, int(inode)))
            elif tag == "T" and listing is not None:
                listing[-1] = Entry(listing[-1].name, "l", listing[-1].inode, rest)
            elif tag == ".":
                listing = None
        killed = self.workdir / "as-killed"
        self.root.rename(killed)  # kept for a failing test's reader
        self._make(".", self.root, dirs, contents)
        return syncs

    def _make(self, relative: str, target: Path, dirs: dict[str, list[Entry]], contents: dict[int, Path]) -> None:
        target.mkdir(mode=0o700)
        for entry in dirs.get(relative, []):
            path = target / entry.name
            if entry.kind == "d":
                self._make(os.path.normpath(os.path.join(relative, entry.name)), path, dirs, contents)
            elif entry.kind == "l":
                path.symlink_to(entry.target)
            elif entry.inode in contents:
                shutil.copyfile(contents[entry.inode], path)
            else:
                path.touch(mode=0o600)  # named by a synced directory, its data never synced
