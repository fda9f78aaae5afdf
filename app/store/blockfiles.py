"""Cache files on disk: safetensors written atomically, with a checksum inside.

A file is written to ``NAME.tmp``, flushed to disk, then renamed over its
final name, so a crash leaves either the old file, the new one, or a ``.tmp``
leftover (removed by the worker's compact job) and never a half-written file
under a name that is served. Each file carries a sha256 of its arrays and
metadata; a file that does not verify is moved to ``quarantine/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file


TEMP_SUFFIX = ".tmp"  # a file being written; renamed into place when complete
log = logging.getLogger(__name__)

CHECKSUM_KEY = "sha256"


class DamagedFile(Exception):
    """A cache file is missing, truncated, malformed or fails its checksum."""


class FileMissing(DamagedFile):
    """A cache file is not there: damage to whoever needs it, but to a scan that listed it
    a moment ago it may only have been replaced (a turn writes a new record, then deletes
    the old one)."""


class FileUnavailable(Exception):
    """A cache file could not be read just now (an I/O error, too many open files): a miss,
    but nothing says the file is damaged."""


def checksum(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    return digest.hexdigest()


def write(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[str, int]:
    """Write atomically; returns (checksum, size in bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    digest = checksum(arrays, meta)
    temporary = path.with_name(path.name + TEMP_SUFFIX)
    save_file(arrays, str(temporary), metadata={**meta, CHECKSUM_KEY: digest})
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return digest, path.stat().st_size


def read_metadata(path: Path) -> dict[str, str]:
    """A file's metadata only (its header), unverified.

    Raises:
        DamagedFile: missing, or its header is not a safetensors header.
        FileUnavailable: an I/O error other than a missing file.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header_size = int.from_bytes(handle.read(8), "little")
            if not 2 <= header_size <= size - 8:
                raise DamagedFile(f"{path}: header length {header_size} does not fit the file's {size} bytes")
            header = json.loads(handle.read(header_size))
            metadata = header.get("__metadata__") if isinstance(header, dict) else None
            return {str(k): str(v) for k, v in (metadata or {}).items()}
    except FileNotFoundError as exc:
        raise FileMissing(f"{path}: missing") from exc
    except OSError as exc:
        raise FileUnavailable(f"{path}: {exc}") from exc
    except (ValueError, AttributeError, RecursionError) as exc:
        raise DamagedFile(f"{path}: unreadable header ({exc})") from exc


def read(path: Path, expected_checksum: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read and verify a file.

    Raises:
        DamagedFile: missing, unreadable, or the checksum does not match.
    """
    metadata = read_metadata(path)
    try:
        arrays = load_file(str(path))
    except FileNotFoundError as exc:
        raise FileMissing(f"{path}: missing") from exc
    except OSError as exc:
        raise FileUnavailable(f"{path}: {exc}") from exc
    except (ValueError, SafetensorError, OverflowError, MemoryError, TypeError) as exc:
        raise DamagedFile(f"{path}: unreadable ({exc})") from exc
    stored = metadata.pop(CHECKSUM_KEY, None)
    actual = checksum(arrays, metadata)
    if stored != actual or (expected_checksum and expected_checksum != actual):
        raise DamagedFile(f"{path}: checksum mismatch")
    return arrays, metadata


def quarantine(path: Path, root: Path) -> Path | None:
    """Move a damaged file out of the way (kept for inspection, never served)."""
    if not path.exists():
        return None
    target = root / "quarantine" / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    log.warning("quarantined damaged cache file %s -> %s", path, target)
    return target
