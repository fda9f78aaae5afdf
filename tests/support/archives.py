"""Agent archives taken apart and put back together, as a forger would: tests of import
change a member and recompute every checksum the archive carries."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path


def unpack(archive_path: Path) -> tuple[dict, dict[str, bytes]]:
    """The archive's manifest (``agent.json``) and its other members' bytes, by name."""
    with tarfile.open(archive_path) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}  # type: ignore[union-attr]
    return json.loads(members.pop("agent.json")), members


def pack(target: Path, manifest: dict, members: dict[str, bytes]) -> Path:
    """An archive of ``members``, ``manifest``'s sha256 list made to match them."""
    manifest["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
    with tarfile.open(target, "w") as archive:
        for name, data in [("agent.json", json.dumps(manifest).encode()), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return target
