"""The cache files, all of them: where they live, their format both ways, verification and
quarantine. No MLX: arrays are numpy here (``blocks.KVBlock`` converts).

Where: under ``<root>/<fingerprint[:16]>/``, one file per full block (content-addressed:
``<hash[:2]>/<hash>.safetensors``) and one record file per conversation and version
(``conversations/<sha256(id)[:32]>-<random>.safetensors``). In a pool the index rows may
name another server's root: the same layout, mapped onto this server's, and a pool's shared
tier holds the same files under the same keys (``<fingerprint[:16]>/...``).

Format: safetensors, written to ``NAME.tmp``, flushed to disk, then renamed over its final
name, so a crash leaves either the old file, the new one, or a ``.tmp`` leftover (removed
by the worker's compact job) and never a half-written file under a name that is served.
Each file carries a checksum of its arrays and metadata: BLAKE3 (``checksum``; files
written before it carry a sha256, which still verifies them). A block file holds the arrays of
every layer (one array a name, the layers stacked where they have one shape:
``blocks.KVBlock.to_numpy``), metadata fingerprint / hash / n_tokens; a record file (a new one each turn,
the previous one deleted once the index points to the new) holds token ids and char ends
as arrays, the private tail block's arrays and, in a hybrid model, the recurrent-state
checkpoints' arrays (``ckpt.<i>.<layer>.<array>``, lossless), metadata agent_id /
conversation_id / text / chain / tail_tokens (/ checkpoints: each one's tokens and dtypes; / salt:
an imported conversation's, ``records.ConversationCache.salt``).
A hybrid model's shared checkpoint (the recurrent state after a block, for every
conversation starting with its tokens) is a file beside the block's,
``<hash[:2]>/<hash>.state.safetensors``: arrays ``<layer>.<array>``, metadata fingerprint /
hash / n_tokens / dtypes, its checksum in the block's index row.

Verification: every read checks the checksum (a shared checkpoint's against its block's
row; a restore's block files once their data is copied into the arrays the model reads, while
it dequantizes them, and before any of it is in memory: ``Unverified``); a block or shared
checkpoint file also that it is this model's
and this block's, a conversation that its record, its index row and its blocks agree. A
file that fails its checksum is moved to ``<root>/quarantine/`` (kept for inspection, never
served) by whoever finds it: the cache manager as it loads a cache, the worker's compact
job as it samples. A file of another model is not damaged: it is only not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import blake3
import numpy as np
from safetensors.numpy import save_file

from app.cache import durable
from app.cache.hashing import BLOCK_TOKENS
from app.cache.records import CacheRecord
from app.cache.shared_tier import Upload

if TYPE_CHECKING:
    from app.cache.records import ConversationCache
    from app.cache.shared_tier import S3Tier
    from app.store.cache_index import BlockRow, CacheEntry

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"  # a file being written; renamed into place when complete
CHECKSUM_KEY = "checksum"  # the metadata entry of a file's checksum ("blake3:" and 56 hex digits)
LEGACY_CHECKSUM_KEY = "sha256"  # of a file written before BLAKE3: a sha256's 64 hex digits
BLAKE3_PREFIX = "blake3:"
# Hex digits of a BLAKE3 checksum: 224 bits, so that with its prefix it fits the index's 64 characters.
BLAKE3_HEX = 56
SHARED_CHECKPOINT_SUFFIX = ".state.safetensors"  # a shared checkpoint, beside its block's file
CHECKPOINT_PREFIX = "ckpt."  # a record file's recurrent-state checkpoints: ckpt.<i>.<layer>.<array>
QUARANTINE = "quarantine"
FETCH_THREADS = 8  # GETs from the shared tier at once, for one conversation
MAX_FETCHED_KEPT = 4096  # files fetched from the tier remembered until a cache reads them (take_fetched)
READ_THREADS = min(8, os.cpu_count() or 1)  # block files read and verified at once, for one conversation

Arrays = dict[str, np.ndarray]
Block = TypeVar("Block")  # what a block file's arrays are made into (``CacheFiles.read_block``)
T = TypeVar("T")
Y = TypeVar("Y")

# Files fetched from the shared tier that no cache has asked about yet (``take_fetched``), by
# their path here: from any thread and any ``CacheFiles`` of the process (the engine's stager
# fetches on a request thread, the model's cache manager reads them on the engine thread);
# the oldest are forgotten past the bound.
_FETCHED: OrderedDict[Path, None] = OrderedDict()
_FETCHED_LOCK = threading.Lock()


class DamagedFile(Exception):
    """A cache file is missing, truncated, malformed or fails its checksum."""


class FileMissing(DamagedFile):
    """A cache file is not there: damage to whoever needs it, but to a scan that listed it
    a moment ago it may only have been replaced (a turn writes a new record, then deletes
    the old one)."""


class FileUnavailable(Exception):
    """A cache file could not be read just now (an I/O error, too many open files): a miss,
    but nothing says the file is damaged."""


# What reading a cache's files can raise besides FileUnavailable: a damaged file, or one
# that verifies but does not fit (another model's shapes, a record that disagrees with its index).
UNUSABLE = (DamagedFile, KeyError, ValueError)


class StorableCheckpoint(Protocol):
    """What a shared checkpoint file is written from (``checkpoints.Checkpoint``)."""

    @property
    def n_tokens(self) -> int: ...

    def to_numpy(self, prefix: str) -> tuple[Arrays, list[list[str]]]: ...


class StorableBlock(Protocol):
    """KV data a block or record file holds (``blocks.KVBlock``)."""

    @property
    def n_tokens(self) -> int: ...

    def to_numpy(self, prefix: str = "") -> Arrays: ...


# -- the container: safetensors with a checksum, written atomically ---------------------------

def checksum(arrays: Arrays, metadata: dict[str, str], like: str | None = None) -> str:
    """The checksum of a file's arrays and metadata: BLAKE3 (``"blake3:"`` and 56 hex digits),
    or a sha256 (64 hex digits, what files written before BLAKE3 carry) if ``like`` (a
    checksum to compare with) is one.

    A restart reads a conversation's every byte through it, and BLAKE3 hashes faster than
    sha256 on one core (docs/benchmarks.md, "Measured choices in the code"). It is a
    cryptographic hash as sha256 is: a file that claims the checksum of an index row holds that
    row's data (``CacheFiles.write_block`` adopts a file on it)."""
    return _digest(((name, arrays[name].dtype.str, arrays[name].shape, [arrays[name]]) for name in sorted(arrays)),
                   metadata, like)


# What a checksum covers of one array: its name, dtype (``np.dtype.str``), shape, and its bytes
# in pieces laid end to end (the array itself, or the arrays its bytes were copied into).
HashedArray = tuple[str, str, tuple[int, ...], Sequence[np.ndarray]]


def _digest(arrays: Iterable[HashedArray], metadata: dict[str, str], like: str | None) -> str:
    """``checksum`` of arrays given in name order, each array's bytes in pieces."""
    legacy = like is not None and not like.startswith(BLAKE3_PREFIX)
    digest = hashlib.sha256() if legacy else blake3.blake3()
    for name, dtype, shape, pieces in arrays:
        digest.update(f"{name}:{dtype}:{tuple(shape)}".encode())
        for piece in pieces:
            digest.update(np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data)  # its bytes, without a copy
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    return digest.hexdigest() if legacy else BLAKE3_PREFIX + digest.hexdigest()[:BLAKE3_HEX]


def _claimed(metadata: dict[str, str]) -> str | None:
    """The checksum a file's metadata claims, under either key."""
    return metadata.get(CHECKSUM_KEY, metadata.get(LEGACY_CHECKSUM_KEY))


def write(path: Path, arrays: Arrays, metadata: dict[str, str]) -> tuple[str, int]:
    """Write atomically; returns (checksum, size in bytes)."""
    durable.make_directories(path.parent)
    meta = {k: v for k, v in metadata.items() if k not in (CHECKSUM_KEY, LEGACY_CHECKSUM_KEY)}
    digest = checksum(arrays, meta)
    temporary = path.with_name(path.name + TEMP_SUFFIX)
    save_file(arrays, str(temporary), metadata={**meta, CHECKSUM_KEY: digest})
    durable.install(temporary, path)
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


def read(path: Path, expected_checksum: str | None = None, reuse: bool = False) -> tuple[Arrays, dict[str, str]]:
    """Read and verify a file (``reuse``: into this thread's reused buffer, ``read_verified``).

    Raises:
        DamagedFile: missing, unreadable, or the checksum does not match.
    """
    arrays, metadata, _ = read_verified(path, expected_checksum, reuse)
    return arrays, metadata


def read_verified(path: Path, expected_checksum: str | None = None,
                  reuse: bool = False) -> tuple[Arrays, dict[str, str], str]:
    """``read``, and the checksum the file verified against (for an index row to hold).

    The file is read whole in one call into one buffer; its arrays are views of that buffer
    (no copy), and hashing them runs outside the GIL, so reads on several threads use
    every core (a restore reads a conversation's blocks side by side). The buffer is not
    cleared first (``np.empty``, not ``bytearray``): the read fills it, and clearing it cost
    the restore a core's time for nothing (docs/benchmarks.md, "Measured choices in the
    code"). With ``reuse`` it is the calling thread's, kept for its next
    read (``_thread_buffer``): the arrays are valid until then, and whoever keeps them copies
    them first."""
    arrays, metadata, stored = _read_unchecked(path, reuse)
    actual = checksum(arrays, metadata, like=stored)
    _check(path, stored, actual, expected_checksum)
    return arrays, metadata, actual


def _read_unchecked(path: Path, reuse: bool) -> tuple[Arrays, dict[str, str], str]:
    """A file's arrays (views of the buffer it was read into: ``read_verified``), its metadata
    without the checksum, and the checksum it claims; not verified.

    Raises:
        DamagedFile: missing, unreadable or malformed, or it claims no checksum.
        FileUnavailable: an I/O error other than a missing file.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            buffer = _thread_buffer(size) if reuse else np.empty(size, dtype=np.uint8).data
            if handle.readinto(buffer) != size:
                raise DamagedFile(f"{path}: shorter than its size")
    except FileNotFoundError as exc:
        raise FileMissing(f"{path}: missing") from exc
    except OSError as exc:
        raise FileUnavailable(f"{path}: {exc}") from exc
    except MemoryError as exc:
        raise DamagedFile(f"{path}: unreadable ({exc})") from exc
    try:
        arrays, metadata = _parse(buffer)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise DamagedFile(f"{path}: unreadable ({exc})") from exc
    stored = metadata.pop(CHECKSUM_KEY if CHECKSUM_KEY in metadata else LEGACY_CHECKSUM_KEY, None)
    if stored is None:
        raise DamagedFile(f"{path}: no checksum")
    return arrays, metadata, stored


def _check(path: Path, stored: str, actual: str, expected: str | None) -> None:
    """Raises DamagedFile unless a file's data hashes to the checksum it claims, and to the
    one expected of it (its index row's), if any."""
    if stored != actual or (expected and expected != actual):
        raise DamagedFile(f"{path}: checksum mismatch")


class VerifiableBlock(Protocol):
    """What a block file's arrays are made into when they are verified after (``Unverified``)."""

    def file_pieces(self, name: str) -> Sequence[np.ndarray]:
        """The bytes of the file's array ``name``, in pieces laid end to end: views of the
        memory its data was copied into."""
        ...


Verifiable = TypeVar("Verifiable", bound=VerifiableBlock)


@dataclass(frozen=True)
class Unverified(Generic[Verifiable]):
    """A block file's data as ``convert`` made it (``CacheFiles.read_block_unverified``), its
    checksum not yet checked: ``verify`` hashes the data where it now is (the memory the
    model will read, not the read buffer, which the reading thread reuses) against what the
    file claims and its index row expects. Whoever reads it this way uses the data only for
    what it can drop (a working copy being built), and puts nothing of it where another
    request can see it until ``verify`` returned: a restore checks the checksums while it
    dequantizes (``loading.Loader``)."""

    path: Path
    data: Verifiable
    arrays: tuple[tuple[str, str, tuple[int, ...]], ...]  # the file's (name, dtype, shape), in name order
    metadata: dict[str, str]
    claimed: str
    expected: str | None

    def verify(self) -> Verifiable:
        """The data, once it hashes to the file's checksum. Raises DamagedFile if it does not."""
        actual = _digest(((name, dtype, shape, self.data.file_pieces(name)) for name, dtype, shape in self.arrays),
                         self.metadata, like=self.claimed)
        _check(self.path, self.claimed, actual, self.expected)
        return self.data


def verify_all(read: Sequence[Unverified[Verifiable]]) -> list[Verifiable]:
    """Each ``Unverified``'s data, verified side by side (hashing runs outside the GIL).
    Raises the first DamagedFile."""
    return _side_by_side(Unverified.verify, read, "cache-verify")


def _side_by_side(function: Callable[[Y], T], items: Sequence[Y], name: str) -> list[T]:
    """``function`` of each item, on up to ``READ_THREADS`` threads named ``name`` (one item:
    on the calling thread), in order. Raises the first item's exception."""
    if len(items) < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(READ_THREADS, len(items)), thread_name_prefix=name) as pool:
        return list(pool.map(function, items))


_reading = threading.local()  # each reading thread's buffer (``_thread_buffer``)


def _thread_buffer(size: int) -> memoryview:
    """``size`` bytes of the calling thread's read buffer, grown as needed and freed with the
    thread. Reading each block file of a restore into its own buffer made the first restore
    after a start fault in fresh memory as large as the conversation (docs/benchmarks.md,
    "Measured choices in the code")."""
    buffer = getattr(_reading, "buffer", None)
    if buffer is None or buffer.nbytes < size:
        buffer = _reading.buffer = np.empty(size, dtype=np.uint8)
    return buffer[:size].data


# safetensors dtype names -> numpy (what the cache files hold; any other is a damaged file)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}


def _parse(buffer: memoryview) -> tuple[Arrays, dict[str, str]]:
    """The arrays (views of ``buffer``) and metadata of a safetensors file's bytes.
    Raises ValueError (or KeyError, TypeError) if they are not a well-formed file."""
    header_size = int.from_bytes(buffer[:8], "little")
    if not 2 <= header_size <= len(buffer) - 8:
        raise ValueError(f"header length {header_size} does not fit the file's {len(buffer)} bytes")
    header = json.loads(bytes(buffer[8:8 + header_size]))
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    metadata = {str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()}
    data = memoryview(buffer)[8 + header_size:]
    arrays: Arrays = {}
    for name, info in header.items():
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(int(n) for n in info["shape"])
        begin, end = (int(n) for n in info["data_offsets"])
        if not 0 <= begin <= end <= len(data) or end - begin != dtype.itemsize * math.prod(shape) \
                or any(n < 0 for n in shape):
            raise ValueError(f"array {name!r} does not fit its bytes")
        arrays[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
    return arrays, metadata


# -- verification and quarantine --------------------------------------------------------------

def quarantine(path: Path, root: Path) -> Path | None:
    """Move a damaged file out of the way (kept for inspection, never served)."""
    if not path.exists():
        return None
    target = root / QUARANTINE / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    os.utime(target)  # its time is when it was quarantined: the janitor keeps it for the retention from then
    log.warning("quarantined damaged cache file %s -> %s", path, target)
    return target


def quarantine_if_damaged(path: Path, root: Path, expected_checksum: str | None = None) -> bool:
    """Verify ``path``; if it is damaged, quarantine it and return True. A file that is gone
    or cannot be read just now is not damage (False: it is checked again another time)."""
    try:
        read(path, expected_checksum)
    except (FileMissing, FileUnavailable):
        return False
    except DamagedFile:
        quarantine(path, root)
        return True
    return False


def check_block(metadata: dict[str, str], fingerprint: str, block: str) -> None:
    """Raises ValueError unless a block file's metadata says it is block ``block`` of the
    model ``fingerprint``."""
    if metadata.get("fingerprint") != fingerprint or metadata.get("hash") != block:
        raise ValueError("the block file belongs to another model or block")


def record_chain(metadata: dict[str, str]) -> list[str] | None:
    """The block ids a record file's metadata lists (None: it lists none)."""
    return json.loads(metadata.get("chain", "null"))


def readdress_record(source: Path, target: Path, agent_id: str, conversation_id: str,
                     expected_checksum: str | None = None, chain: list[str] | None = None) -> str:
    """Write record file ``source`` (verified, against ``expected_checksum`` if given) to
    ``target``, naming another agent and conversation (and, given ``chain``, other block
    ids): a forked agent's copy, an imported agent's record. Returns the new file's checksum."""
    arrays, meta = read(source, expected_checksum)
    meta = {**meta, "agent_id": agent_id, "conversation_id": conversation_id}
    if chain is not None:
        meta["chain"] = json.dumps(chain)
    digest, _ = write(target, arrays, meta)
    return digest


def _checkpoints(arrays: Arrays, meta: dict[str, str],
                 n_tokens: int) -> tuple[tuple[int, Arrays, list[list[str]]], ...]:
    """The recurrent-state checkpoints a record file holds (``StoredConversation.checkpoints``).
    Raises ValueError if its metadata does not describe them."""
    listed = json.loads(meta.get("checkpoints", "[]"))
    out = []
    for i, (at, dtypes) in enumerate(listed):
        if not 0 < int(at) <= n_tokens:
            raise ValueError("a checkpoint lies outside the record")
        prefix = f"{CHECKPOINT_PREFIX}{i}."
        out.append((int(at), {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)},
                    [[str(d) for d in layer] for layer in dtypes]))
    return tuple(out)


def _integers(array: np.ndarray) -> tuple[int, ...]:
    """A record's token ids or char ends as Python ints (``tolist``, not an ``int()`` each:
    docs/benchmarks.md, "Measured choices in the code"). Raises ValueError unless the array
    is a list of integers."""
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"a record array of shape {array.shape} and dtype {array.dtype}, not integers")
    return tuple(array.tolist())


def mark_used(path: Path) -> None:
    """Note that a cache file was just read (its access time, set explicitly: mounts with
    ``noatime`` or ``relatime`` do not), so the janitor deletes the least recently used first."""
    try:
        os.utime(path, (time.time(), path.stat().st_mtime))
    except OSError:  # gone or read-only: nothing to note
        pass


def last_used(path: Path) -> float:
    """When a cache file was last written or read (``mark_used``), in seconds since the epoch.
    Raises FileNotFoundError if it is gone."""
    status = path.stat()
    return max(status.st_mtime, status.st_atime)


def quarantined_files(root: Path) -> Iterator[Path]:
    """The damaged files moved aside under ``root`` (``quarantine``)."""
    folder = root / QUARANTINE
    return (path for path in folder.iterdir() if path.is_file()) if folder.is_dir() else iter(())


def temporary_files(root: Path) -> Iterator[Path]:
    """Files being written under ``root``, or left half-written by a crash."""
    return root.rglob(f"*{TEMP_SUFFIX}") if root.exists() else iter(())


def cache_files(root: Path) -> Iterator[Path]:
    """Every block and record file under ``root`` (the quarantined ones aside)."""
    quarantined = root / QUARANTINE
    return (path for path in (root.rglob("*.safetensors") if root.exists() else ())
            if quarantined not in path.parents)


# -- one model's files ------------------------------------------------------------------------

def tier_key(stored: str | Path, fingerprint: str) -> str | None:
    """The object key of the file an index row names (whichever server's root it is under),
    or None if the path is not under a ``<fingerprint[:16]>`` directory."""
    parts = Path(stored).parts
    tag = fingerprint[:16]
    return "/".join(parts[parts.index(tag):]) if tag in parts else None


@dataclass(frozen=True)
class StoredConversation(Generic[Block]):
    """A conversation's cache as its files hold it, verified: its record, its full blocks'
    ids and those read (as ``CacheFiles.read_conversation``'s ``convert`` made them), and its
    private tail's arrays."""

    record: CacheRecord
    chain: tuple[str, ...]
    blocks: dict[str, Block]  # the chain's blocks that were read (not those skipped)
    tail: Arrays | None
    tail_tokens: int
    # Recurrent-state checkpoints (hybrid models): (tokens, arrays named CHECKPOINT_PREFIX
    # + "<layer>.<array>", each array's dtype by layer), oldest first.
    checkpoints: tuple[tuple[int, Arrays, list[list[str]]], ...] = ()
    salt: str | None = None  # some of its data is an import's (``records.ConversationCache.salt``)


def claimed_checksum(path: Path) -> str | None:
    """The checksum the file at ``path`` claims in its metadata (None: no file there, or
    metadata that cannot be read)."""
    try:
        return _claimed(read_metadata(path)) if path.exists() else None
    except DamagedFile:
        return None


class CacheFiles:
    """One model's cache files (``fingerprint``) under ``root``: where each lives, here and
    in a pool's shared ``tier``, and their contents both ways."""

    def __init__(self, root: Path, fingerprint: str, tier: S3Tier | None = None) -> None:
        self.root = root
        self.base = root / fingerprint[:16]
        self.fingerprint = fingerprint
        self.tier = tier

    def key(self, path: Path) -> str:
        """A file's name in the shared tier: its path below the root (``<fingerprint[:16]>/...``)."""
        return path.relative_to(self.root).as_posix()

    def upload(self, blocks: Iterable[Path], record: Path) -> Upload:
        """A conversation's files (this server's paths) to copy to the shared tier, each under
        its key: ``blocks``, then ``record`` (``shared_tier.upload_conversation``)."""
        return Upload(tuple((self.key(path), path) for path in blocks), (self.key(record), record))

    def local(self, stored: str | Path, fetch: bool = True) -> Path:
        """Where this server keeps the file an index row names (the row may have been written by
        another server of a pool: same layout, another root). Missing here and ``fetch``: copied
        from the shared tier first, if there is one and it holds the file."""
        key = tier_key(stored, self.fingerprint)
        local = self.root.joinpath(*key.split("/")) if key is not None else Path(stored)
        if fetch and self.tier is not None and not local.exists():
            try:
                if self.tier.fetch(self.key(local), local):
                    log.info("restored %s from the shared tier", self.key(local))
                    with _FETCHED_LOCK:
                        _FETCHED[local] = None
                        while len(_FETCHED) > MAX_FETCHED_KEPT:
                            _FETCHED.popitem(last=False)
            except Exception as exc:  # the tier is down: the file is missing, a miss
                log.warning("shared tier: %s not fetched (%s)", self.key(local), exc)
        return local

    def take_fetched(self, stored: Iterable[str | Path]) -> bool:
        """Whether any of these files came from the shared tier since they were last asked
        about (a cache's provenance: ``tier`` rather than ``disk``); each is forgotten once asked."""
        paths = [self.local(path, fetch=False) for path in stored]
        with _FETCHED_LOCK:
            found = [path for path in paths if path in _FETCHED]
            for path in found:
                del _FETCHED[path]
        return bool(found)

    def fetch_missing(self, stored: Iterable[str | Path]) -> None:
        """Copy from the shared tier those of these files that are not here, side by side
        (each GET waits on the network, not the CPU: a restore's blocks come in together)."""
        if self.tier is None:
            return
        missing = [path for path in stored if not self.local(path, fetch=False).exists()]
        if len(missing) > 1:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(missing)), thread_name_prefix="tier-fetch") as pool:
                list(pool.map(self.local, missing))

    def block_path(self, block: str) -> Path:
        return self.base / block[:2] / f"{block}.safetensors"

    def checkpoint_path(self, block: str) -> Path:
        """Where the shared checkpoint after block ``block`` lives: beside the block's file."""
        return self.base / block[:2] / f"{block}{SHARED_CHECKPOINT_SUFFIX}"

    def write_shared_checkpoint(self, block: str, point: StorableCheckpoint,
                                indexed: str | None = None) -> tuple[Path, str]:
        """Write the shared checkpoint after block ``block`` (the recurrent state after its
        first ``point.n_tokens`` tokens) unless the file there claims ``indexed`` (the
        checksum the block's row holds); returns (path, the checksum of the file now there).
        Any other file there is replaced, never adopted (as ``write_block``)."""
        path = self.checkpoint_path(block)
        claimed = claimed_checksum(path)
        if claimed is not None and claimed == indexed:
            return path, claimed
        arrays, dtypes = point.to_numpy("")
        digest, _ = write(path, arrays, {"fingerprint": self.fingerprint, "hash": block,
                                         "n_tokens": str(point.n_tokens), "dtypes": json.dumps(dtypes)})
        return path, digest

    def read_shared_checkpoint(self, block: str, path: str | Path, checksum: str,
                               n_tokens: int) -> tuple[Arrays, list[list[str]]]:
        """The arrays and dtypes of the shared checkpoint after block ``block``, verified
        against ``checksum`` (its index row's), to be this model's, this block's and at
        ``n_tokens``.

        Raises:
            One of UNUSABLE, or FileUnavailable.
        """
        local = self.local(path)
        arrays, meta = read(local, checksum)
        mark_used(local)
        if meta.get("fingerprint") != self.fingerprint or meta.get("hash") != block or \
                meta.get("n_tokens") != str(n_tokens):
            raise ValueError(f"checkpoint file {local} belongs to another model, block or position")
        return arrays, [[str(d) for d in layer] for layer in json.loads(meta["dtypes"])]

    def record_path(self, conversation_id: str) -> Path:
        """A new file for the conversation's record: records are versioned (the old one is
        deleted only after the row pointing to the new one is committed)."""
        name = hashlib.sha256(conversation_id.encode()).hexdigest()[:32]
        return self.base / "conversations" / f"{name}-{uuid.uuid4().hex[:12]}.safetensors"

    def write_block(self, block: str, data: StorableBlock, indexed: str | None = None) -> tuple[Path, str]:
        """Write a full block unless its file holds it already; returns (path, the checksum of
        the file now there).

        A file already at the block's address is kept only if it claims ``indexed`` (the
        checksum the block's index row holds: the file this home wrote, verified against
        it on every read) or exactly ``data``. Any other file there (left by a crash, a
        refused import, a forger) is never adopted: ``data`` replaces it.
        """
        path = self.block_path(block)
        claimed = claimed_checksum(path)
        if claimed is not None and claimed == indexed:
            return path, claimed
        arrays = data.to_numpy()
        meta = {"fingerprint": self.fingerprint, "hash": block, "n_tokens": str(data.n_tokens)}
        if claimed is not None and claimed == checksum(arrays, meta, like=claimed):
            return path, claimed
        if claimed is not None:
            log.warning("block file %s is not this home's (checksum %s); replaced", path, claimed[:12])
        digest, _ = write(path, arrays, meta)
        return path, digest

    def write_record(self, cache: ConversationCache) -> tuple[Path, str]:
        """Write a new record file for the conversation; returns (its path, its checksum)."""
        arrays = {"tokens": np.array(cache.record.tokens, dtype=np.int64),
                  "ends": np.array(cache.record.ends, dtype=np.int64)}
        if cache.tail is not None:
            arrays.update(cache.tail.to_numpy("tail."))
        checkpoints = []
        for i, point in enumerate(cache.checkpoints):
            point_arrays, dtypes = point.to_numpy(f"{CHECKPOINT_PREFIX}{i}.")
            arrays.update(point_arrays)
            checkpoints.append([point.n_tokens, dtypes])
        path = self.record_path(cache.conversation_id)
        meta = {"agent_id": cache.agent_id, "conversation_id": cache.conversation_id, "text": cache.record.text,
                "chain": json.dumps(list(cache.chain)), "tail_tokens": str(cache.tail.n_tokens if cache.tail else 0)}
        if checkpoints:
            meta["checkpoints"] = json.dumps(checkpoints)
        if cache.salt is not None:
            meta["salt"] = cache.salt
        digest, _ = write(path, arrays, meta)
        return path, digest

    def copy_record(self, source: str | Path, agent_id: str, conversation_id: str,
                    expected_checksum: str | None = None) -> tuple[Path, str]:
        """A record file of its own for ``conversation_id`` of ``agent_id``, holding what the
        record file ``source`` holds (its blocks are shared by reference); returns (its path,
        its checksum)."""
        target = self.record_path(conversation_id)
        digest = readdress_record(self.local(source), target, agent_id, conversation_id, expected_checksum)
        return target, digest

    def read_block(self, block: str, path: str | Path, checksum: str | None,
                   convert: Callable[[Arrays], Block]) -> Block:
        """A stored full block, verified to be this model's and this id's, as ``convert`` makes
        it of its arrays. The arrays are read into the calling thread's reused buffer
        (``read_verified``): ``convert`` copies what it keeps (``blocks.KVBlock.from_numpy``
        does) and runs on the reading thread.

        Raises:
            One of UNUSABLE (``convert``'s KeyError or ValueError too), or FileUnavailable.
        """
        path = self.local(path)
        arrays, meta = read(path, checksum, reuse=True)
        return self._convert(block, path, arrays, meta, convert)

    def read_block_unverified(self, block: str, path: str | Path, checksum: str | None,
                              convert: Callable[[Arrays], Verifiable]) -> Unverified[Verifiable]:
        """``read_block`` but for the checksum, left to ``Unverified.verify`` (which hashes
        the data ``convert`` copied the arrays into): its metadata is checked here, unverified,
        and again by the checksum, which covers it."""
        path = self.local(path)
        arrays, meta, claimed = _read_unchecked(path, reuse=True)
        made = self._convert(block, path, arrays, meta, convert)
        layout = tuple((name, arrays[name].dtype.str, arrays[name].shape) for name in sorted(arrays))
        return Unverified(path, made, layout, meta, claimed, checksum)

    def _convert(self, block: str, path: Path, arrays: Arrays, meta: dict[str, str],
                 convert: Callable[[Arrays], T]) -> T:
        mark_used(path)
        try:
            check_block(meta, self.fingerprint, block)
        except ValueError:
            raise ValueError(f"block file {path} belongs to another model or block") from None
        return convert(arrays)

    def read_conversation(self, entry: CacheEntry, convert: Callable[[Arrays], Block],
                          skip: Container[str] = ()) -> StoredConversation[Block]:
        """A conversation's cache from its record file and the block files its index row
        lists, each block as ``convert`` makes it (``read_block``; blocks in ``skip``, already
        in memory, are not read again).

        Raises:
            One of UNUSABLE (a file is missing or damaged, or the files disagree), or
            FileUnavailable.
        """
        return self._read_conversation(entry, lambda row: self.read_block(row.hash, row.path, row.checksum or None,
                                                                          convert), skip)

    def read_conversation_unverified(self, entry: CacheEntry, convert: Callable[[Arrays], Verifiable],
                                     skip: Container[str] = ()) -> StoredConversation[Unverified[Verifiable]]:
        """``read_conversation`` with its block files' checksums left to check
        (``read_block_unverified``; its record file is verified)."""
        return self._read_conversation(
            entry, lambda row: self.read_block_unverified(row.hash, row.path, row.checksum or None, convert), skip)

    def _read_conversation(self, entry: CacheEntry, read_block: Callable[[BlockRow], T],
                           skip: Container[str]) -> StoredConversation[T]:
        record_path = self.local(entry.record_path)
        arrays, meta = read(record_path, entry.record_checksum)
        mark_used(record_path)
        record = CacheRecord(_integers(arrays["tokens"]), meta["text"], _integers(arrays["ends"]))
        chain = tuple(json.loads(meta["chain"]))
        if chain != tuple(b.hash for b in entry.blocks):
            raise ValueError("record file and index disagree on the block chain")
        needed = [row for row in entry.blocks if row.hash not in skip]
        self.fetch_missing(row.path for row in needed)
        blocks = dict(zip((row.hash for row in needed), self._read_blocks(needed, read_block)))
        tail_tokens = int(meta["tail_tokens"])
        tail = {k.removeprefix("tail."): v for k, v in arrays.items() if k.startswith("tail.")} if tail_tokens else None
        if len(chain) * BLOCK_TOKENS + tail_tokens != record.n_tokens:
            raise ValueError("blocks do not cover the record")
        return StoredConversation(record, chain, blocks, tail, tail_tokens, _checkpoints(arrays, meta, record.n_tokens),
                                  meta.get("salt"))

    @staticmethod
    def _read_blocks(rows: list[BlockRow], read_block: Callable[[BlockRow], T]) -> list[T]:
        """``read_block`` of each row, side by side: reading and hashing a file wait on the
        disk and on the hash, which run outside the GIL, so a restore uses every core."""
        return _side_by_side(read_block, rows, "cache-read")

    def read_text(self, record_path: str) -> str:
        """The text a stored record spells (its header only, unverified: for matching;
        the whole file is verified before its KV data is used). Raises DamagedFile."""
        return read_metadata(self.local(record_path)).get("text", "")

    def quarantine_damaged(self, entry: CacheEntry) -> None:
        """Quarantine those of a cache's files (as its index row lists them) that are damaged:
        each checked against the checksum its row holds, as a read checks it. A block file
        that verifies on its own but is not the one its row names (a forger's, a refused
        import's) is damage too: the worker's sample quarantines it so (``upkeep``), and
        left in place it would fail every conversation that shares the block until a turn
        rewrites it."""
        for path, expected in ((entry.record_path, entry.record_checksum),
                               *((b.path, b.checksum) for b in entry.blocks)):
            quarantine_if_damaged(self.local(path, fetch=False), self.root, expected or None)
