"""One agent as one portable file: its identity, its history and its cache blocks.

``semantic agents export ID > agent.tar`` and ``semantic agents import agent.tar``
move an agent to another home, server or machine, warm: the file is a tar archive
holding ``agent.json`` (the agent row, its conversations with their messages, and
each conversation's caches: model fingerprint, tokens, record and block list) and
the cache files themselves (``blocks/<hash>.safetensors``, ``records/<n>.safetensors``).
``agent.json`` names every other member with its sha256. Import reads members only by
those names (nothing is extracted as the archive says), verifies every file (its
sha256, its own checksum, a block's id, tokens and model), and writes nothing to the
database unless all of it verifies; then the agent, its history and its cache index
go in one transaction, with its request rows and stored Responses API objects
(``agent_log.py``: a client's ``previous_response_id`` continues where the agent lands).

In a pool, export reads the cache files a server of the pool wrote from the shared tier when
this host's disk lacks them, fetched into a temporary directory (never into this home's
``blocks/``, which no server may be using), and import copies its files to the tier.

Whoever writes an archive can forge its KV data with every checksum recomputed: what
an archive holds serves the imported agent and no other (``import_agent``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app import __version__
from app.agents.agent_log import export_log, import_log
from app.agents.identity import ORIGINS
from app.cache import durable
from app.cache import files as cache_files
from app.cache.files import CacheFiles
from app.cache.hashing import BLOCK_TOKENS, block_hash, private_fingerprint
from app.cache.shared_tier import S3Tier, upload_conversation
from app.clock import utcnow
from app.errors import InvalidRequest, NotFound
from app.store import agents as agents_store
from app.store import cache_index
from app.store.db import write_locked
from app.store.history import new_conversation_id
from app.types import SESSION_ID_PATTERN

FORMAT = "semantic-agent"
VERSION = 1
MANIFEST = "agent.json"
log = logging.getLogger(__name__)

MEMBER = re.compile(r"(blocks|records)/[A-Za-z0-9_-]{1,128}\.safetensors")
FINGERPRINT = re.compile(r"[0-9a-f]{64}")  # a model fingerprint, a sha256 (it names a directory)
AGENT_ID = re.compile(SESSION_ID_PATTERN)
# An archive's members are copied to the home (verified one at a time, each read whole then):
# each at most this large (a block of a 70B-class model in float32 is 160 MiB), its agent.json,
# read into memory, smaller still. A sparse member (GNU sparse:
# a few bytes that expand to gigabytes as they are read) is refused whatever its size.
MAX_MEMBER_BYTES = 512 << 20
MAX_MANIFEST_BYTES = 64 << 20
SPOOL_CHUNK_BYTES = 1 << 20  # an archive's member is copied to the home this much at a time
SPOOL_MARGIN_BYTES = 256 << 20  # free space an import leaves in the home beyond what it copies

# A cache as staged: its description in agent.json, its record file, that file's checksum, its block rows.
_StagedCache = tuple[dict[str, Any], Path, str, list[cache_index.BlockRow]]
_Plan = list[tuple[dict[str, Any], str, list[_StagedCache]]]  # conversation, its new id, its caches


@dataclass(frozen=True, slots=True)
class Imported:
    agent_id: str
    n_conversations: int
    n_messages: int
    n_cached_tokens: int  # over the conversations' caches
    n_blocks_new: int  # block files this home did not hold yet
    n_requests: int = 0  # request rows imported
    n_responses: int = 0  # stored Responses API objects imported
    n_log_skipped: int = 0  # request rows and responses whose ids this store held already


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def export_agent(sessions: sessionmaker[Session], root: Path, agent_id: str, out: IO[bytes],
                 tier: S3Tier | None = None) -> dict[str, Any]:
    """Write the agent's archive to ``out``; returns its manifest. Cache files missing on
    this disk come from the shared tier if there is one (fetched into a temporary directory
    removed before this returns, not into ``root``); a cache whose files are gone is left
    out (its conversation travels cold).

    Raises:
        NotFound: no such agent.
    """
    with tempfile.TemporaryDirectory(prefix="semantic-export-") as spool:
        return _export(sessions, root, agent_id, out, tier, Path(spool))


def _export(sessions: sessionmaker[Session], root: Path, agent_id: str, out: IO[bytes], tier: S3Tier | None,
            spool: Path) -> dict[str, Any]:
    files: dict[str, bytes] = {}
    with sessions() as session:
        agent = agents_store.get(session, agent_id)
        if agent is None:
            raise NotFound(f"agent {agent_id!r} does not exist")
        conversations = []
        for conversation in agents_store.conversations(session, agent_id):
            messages = agents_store.history(session, agent_id, conversation.id)
            caches = []
            for fingerprint, entry in cache_index.conversation_caches(session, conversation.id):
                fetched = CacheFiles(spool, fingerprint, tier) if tier is not None else None
                described = _export_cache(CacheFiles(root, fingerprint), fetched, entry, files)
                if described is not None:
                    caches.append({"fingerprint": fingerprint, **described})
            conversations.append({
                "id": conversation.id, "system_digest": conversation.system_digest,
                "snapshot": conversation.snapshot, "thread": conversation.thread,
                "created_at": _time(conversation.created_at), "last_access_at": _time(conversation.last_access_at),
                "messages": [{"position": m.position, "role": m.role, "content": m.content, "digest": m.digest,
                              "created_at": _time(m.created_at), "request_id": m.request_id,
                              "n_tokens": None}  # no longer stored; version 1 readers expect the key
                             for m in messages],
                "caches": caches})
        manifest = {
            "format": FORMAT, "version": VERSION, "semantic_version": __version__, "exported_at": _time(utcnow()),
            "agent": {"id": agent.id, "origin": agent.origin, "parent_id": agent.parent_id,
                      "created_at": _time(agent.created_at), "last_access_at": _time(agent.last_access_at),
                      "ttl_seconds": agent.ttl_seconds, "hot_ttl_seconds": agent.hot_ttl_seconds,
                      "status": agent.status, "metadata": agent.metadata_json or {}},
            "conversations": conversations,
            **export_log(session, agent_id),
            "files": {name: _sha256(data) for name, data in files.items()},
        }
    with tarfile.open(fileobj=out, mode="w|") as archive:
        _add(archive, MANIFEST, json.dumps(manifest, indent=1).encode())
        for name, data in files.items():
            _add(archive, name, data)
    return manifest


def _export_cache(home: CacheFiles, fetched: CacheFiles | None, entry: cache_index.CacheEntry,
                  files: dict[str, bytes]) -> dict[str, Any] | None:
    """Add a cache's files to ``files`` (this home's copy of each, else the one ``fetched``
    holds, copied from the shared tier); returns its description (None: a file is gone)."""
    stored = [entry.record_path, *(row.path for row in entry.blocks)]
    missing = [path for path in stored if not home.local(path, fetch=False).exists()]
    if missing and fetched is not None:
        fetched.fetch_missing(missing)

    def read(path: str) -> bytes:
        local = home.local(path, fetch=False)
        return (local if local.exists() or fetched is None else fetched.local(path)).read_bytes()

    try:
        record = read(entry.record_path)
        blocks = {row.hash: read(row.path) for row in entry.blocks}
    except FileNotFoundError:
        return None
    name = f"records/{len([n for n in files if n.startswith('records/')])}.safetensors"
    files[name] = record
    files.update((f"blocks/{block}.safetensors", data) for block, data in blocks.items())
    return {"n_tokens": entry.n_tokens, "record": name,
            "blocks": [{"hash": row.hash, "parent_hash": row.parent_hash, "n_tokens": row.n_tokens,
                        "checksum": row.checksum} for row in entry.blocks]}


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(utcnow().timestamp())
    archive.addfile(info, io.BytesIO(data))


def import_agent(sessions: sessionmaker[Session], root: Path, source: IO[bytes], new_id: str | None = None,
                 tier: S3Tier | None = None) -> Imported:
    """Verify an exported agent whole, then add it (as ``new_id`` if given) to this store.
    Conversations get new ids; messages keep their order, digests and times.

    An archive's KV data cannot be checked without recomputing it, so it is trusted for the
    imported agent alone: a block is shared with this home's other agents only if this home
    holds the same block, byte for byte; every other block (and every block after it in its
    chain) gets a private id (``private_fingerprint``), which no other agent's prompt hashes to.
    So does every block the imported conversations fill later (their records' tails are the
    archive's KV too, and their turns compute on top of it): each record carries the import's
    salt, kept by its later records, forks and exports.
    Its message digests are not checked either, so they steer only requests that name the
    imported agent: one that was recognised by content is imported with origin ``imported``,
    which content matching never reaches. A refused import removes every file it wrote.

    Raises:
        InvalidRequest: not an agent archive, a file that does not verify, or the id is taken.
    """
    durable.make_directories(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as spool:
        return _import(sessions, root, *_read_archive(source, Path(spool)), new_id, tier)


def _import(sessions: sessionmaker[Session], root: Path, manifest: dict[str, Any], members: dict[str, Path],
            new_id: str | None, tier: S3Tier | None) -> Imported:
    agent = manifest["agent"]
    agent_id = new_id or agent["id"]
    if not isinstance(agent_id, str) or not AGENT_ID.fullmatch(agent_id):
        raise InvalidRequest(f"agent id {str(agent_id)[:80]!r} is not 1-128 letters, digits or ._:-", "id")
    if agent.get("origin") not in ORIGINS:
        raise InvalidRequest(f"archive: origin {str(agent.get('origin'))[:80]!r} is not one of "
                             f"{', '.join(sorted(ORIGINS))}", "archive")
    with sessions() as session:  # checked again below, under the write lock
        taken = agents_store.get(session, agent_id) is not None
    if taken:
        raise InvalidRequest(f"agent {agent_id!r} already exists here (import it --as another id)", "id")
    written: list[Path] = []  # every file this import wrote, removed if it is refused
    staging = _Staging(sessions, root, members, uuid.uuid4().hex, written)
    try:
        plan = []
        for conversation in manifest["conversations"]:
            conversation_id = new_conversation_id()
            plan.append((conversation, conversation_id,
                         [staging.cache(cache, agent_id, conversation_id) for cache in conversation["caches"]]))
        with write_locked(sessions) as session:
            if agents_store.get(session, agent_id) is not None:
                raise InvalidRequest(f"agent {agent_id!r} already exists here (import it --as another id)", "id")
            n_messages, n_tokens = _insert(session, agent, agent_id, plan)
            log_rows = import_log(session, manifest, agent_id, {str(c["id"]): new for c, new, _ in plan})
            _link_requests(session, plan, log_rows.requests)
    except BaseException as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if isinstance(exc, (KeyError, TypeError, ValueError, AttributeError)):  # a field missing or of a wrong type
            raise InvalidRequest(f"archive: agent.json is malformed ({type(exc).__name__}: {exc})",
                                 "archive") from exc
        if isinstance(exc, IntegrityError):  # e.g. two messages at one position
            raise InvalidRequest(f"archive: agent.json's rows contradict each other ({exc.orig})", "archive") from exc
        raise
    if tier is not None:
        _upload(tier, root, plan)
    return Imported(agent_id, len(plan), n_messages, n_tokens, staging.n_new, len(log_rows.requests),
                    log_rows.n_responses, log_rows.n_skipped)


def _read_archive(source: IO[bytes], spool: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """The archive's manifest, and each of its files copied to ``spool`` (in the home, not in
    memory: an archive is as large as its agent's caches), each file hashed as it is copied
    and checked against the manifest's sha256 list."""
    members: dict[str, Path] = {}
    digests: dict[str, str] = {}
    manifest_bytes: bytes | None = None
    try:
        with tarfile.open(fileobj=source, mode="r|") as archive:
            for member in archive:
                if not member.isfile() or (member.name != MANIFEST and not MEMBER.fullmatch(member.name)):
                    raise InvalidRequest(f"archive: unexpected member {member.name[:200]!r}", "archive")
                if member.name in members or (member.name == MANIFEST and manifest_bytes is not None):
                    raise InvalidRequest(f"archive: member {member.name!r} appears twice", "archive")
                limit = MAX_MANIFEST_BYTES if member.name == MANIFEST else MAX_MEMBER_BYTES
                if member.issparse() or member.size > limit:
                    raise InvalidRequest(f"archive: member {member.name!r} is sparse or larger than {limit} bytes",
                                         "archive")
                handle = archive.extractfile(member)
                if member.name == MANIFEST:
                    manifest_bytes = b"".join(_chunks(handle, member.name, limit))
                    continue
                free = shutil.disk_usage(spool).free
                if member.size + SPOOL_MARGIN_BYTES > free:
                    raise InvalidRequest(f"archive: no room in the home for {member.name} ({member.size} bytes, "
                                         f"{free} free)", "archive")
                path = spool / f"{len(members)}{cache_files.TEMP_SUFFIX}"
                digests[member.name] = _spooled(handle, path, member.name, limit)
                members[member.name] = path
    except tarfile.TarError as exc:
        raise InvalidRequest(f"archive: not a tar archive ({exc})", "archive") from exc
    try:
        manifest = json.loads(manifest_bytes if manifest_bytes is not None else b"")
    except ValueError as exc:
        raise InvalidRequest("archive: no readable agent.json (not an exported agent)", "archive") from exc
    except RecursionError:
        raise InvalidRequest("archive: agent.json is nested too deeply (not an exported agent)", "archive") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise InvalidRequest(f"archive: not a {FORMAT} version {VERSION} file", "archive")
    if not isinstance(manifest.get("agent"), dict) or not isinstance(manifest["agent"].get("id"), str) \
            or not isinstance(manifest.get("conversations"), list) or not isinstance(manifest.get("files"), dict):
        raise InvalidRequest("archive: agent.json lacks its agent, conversations or files", "archive")
    listed = manifest.get("files", {})
    if set(listed) != set(members):
        raise InvalidRequest("archive: its files and agent.json's list differ", "archive")
    for name, digest in listed.items():
        if digests[name] != digest:
            raise InvalidRequest(f"archive: {name} is damaged (sha256 mismatch)", "archive")
    return manifest, members


def _spooled(handle: IO[bytes] | None, path: Path, name: str, limit: int) -> str:
    """Copy a member to ``path`` a chunk at a time; returns its sha256."""
    sha = hashlib.sha256()
    with open(path, "wb") as out:
        for chunk in _chunks(handle, name, limit):
            sha.update(chunk)
            out.write(chunk)
    return sha.hexdigest()


def _chunks(handle: IO[bytes] | None, name: str, limit: int) -> Iterator[bytes]:
    """A member's bytes a chunk at a time, never more than ``limit`` in all whatever its
    header said (a read of ``limit`` bytes at once would allocate them all up front)."""
    n_bytes = 0
    while handle is not None and (chunk := handle.read(SPOOL_CHUNK_BYTES)):
        n_bytes += len(chunk)
        if n_bytes > limit:
            raise InvalidRequest(f"archive: member {name!r} is larger than {limit} bytes", "archive")
        yield chunk


class _Staging:
    """Writes an import's cache files in place, verified, and says what to index."""

    def __init__(self, sessions: sessionmaker[Session], root: Path, members: dict[str, Path], salt: str,
                 written: list[Path]) -> None:
        self._sessions = sessions
        self._root = root
        self._members = members
        self._salt = salt
        self.written = written
        self.n_new = 0  # block files written (not this home's already)

    def cache(self, cache: dict[str, Any], agent_id: str, conversation_id: str) -> _StagedCache:
        """Verify one cache of the archive and write its files for ``conversation_id``.

        Returns:
            The cache's description, its record file's path and checksum, and its block rows.
        """
        fingerprint = str(cache["fingerprint"])
        if not FINGERPRINT.fullmatch(fingerprint):
            raise InvalidRequest(f"archive: {fingerprint[:80]!r} is not a model fingerprint", "archive")
        layout = CacheFiles(self._root, fingerprint)
        record, meta, _ = self._verified(layout, str(cache["record"]))
        tokens = [int(t) for t in record["tokens"]]
        claimed = list(cache["blocks"])
        if cache_files.record_chain(meta) != [str(b["hash"]) for b in claimed] \
                or int(cache["n_tokens"]) != len(tokens) or len(claimed) * BLOCK_TOKENS > len(tokens):
            raise InvalidRequest("archive: a record and its block list disagree", "archive")
        private = private_fingerprint(fingerprint, self._salt)
        rows: list[cache_index.BlockRow] = []
        parent: str | None = None  # the archive's id of the previous block
        n_home = 0  # the first rows: this home's own blocks
        for i, block in enumerate(claimed):
            span = tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]
            block_id = str(block["hash"])
            if block.get("parent_hash") != parent:
                raise InvalidRequest(f"archive: block {block_id[:80]!r} is not the block of its chain", "archive")
            name = f"blocks/{block_id}.safetensors"
            arrays, block_meta, _ = self._verified(layout, name)
            try:
                cache_files.check_block(block_meta, fingerprint, block_id)
            except ValueError:
                raise InvalidRequest(f"archive: block {block_id} belongs to another model or block",
                                     "archive") from None
            row = self._home_block(layout, rows[-1].hash if rows else None, span, arrays) \
                if len(rows) == n_home else None
            n_home += row is not None
            rows.append(row or self._private_block(layout, private, rows[-1].hash if rows else None, span, arrays))
            parent = block_id
        record_path = layout.record_path(conversation_id)
        self.written.append(record_path)
        # The record's tail and checkpoints are the archive's too: the conversation carries the
        # salt, and the blocks its later turns fill are private as well (``ConversationCache.salt``).
        record_checksum, _ = cache_files.write(record_path, record, {
            **meta, "agent_id": agent_id, "conversation_id": conversation_id,
            "chain": json.dumps([row.hash for row in rows]), "salt": self._salt})
        return cache, record_path, record_checksum, rows

    def _verified(self, layout: CacheFiles, name: str) -> tuple[cache_files.Arrays, dict[str, str], str]:
        """A member's arrays, metadata and checksum, verified (its own checksum)."""
        if name not in self._members:
            raise InvalidRequest(f"archive: {name} is missing", "archive")
        durable.make_directories(layout.base)
        try:
            return cache_files.read_verified(self._members[name])
        except cache_files.DamagedFile as exc:
            raise InvalidRequest(f"archive: {name} does not verify ({exc})", "archive") from exc

    def _home_block(self, layout: CacheFiles, parent: str | None, span: list[int],
                    arrays: cache_files.Arrays) -> cache_index.BlockRow | None:
        """This home's own block after ``parent`` for the tokens ``span`` (its id computed here),
        if its file holds exactly ``arrays``."""
        block = block_hash(layout.fingerprint, parent, span)
        meta = {"fingerprint": layout.fingerprint, "hash": block, "n_tokens": str(BLOCK_TOKENS)}
        with self._sessions() as session:
            found = cache_index.block_file(session, block)
        if found is None or found[1] != cache_files.checksum(arrays, meta, like=found[1]):
            return None
        path = layout.local(found[0], fetch=False)
        if not path.exists():
            return None
        return cache_index.BlockRow(block, parent, BLOCK_TOKENS, found[0], path.stat().st_size, found[1])

    def _private_block(self, layout: CacheFiles, private: str, parent: str | None, span: list[int],
                       arrays: cache_files.Arrays) -> cache_index.BlockRow:
        """A file of the archive's ``arrays`` at a private id (``private``: the fingerprint its
        ids chain from), after ``parent``."""
        block = block_hash(private, parent, span)
        path = layout.block_path(block)
        self.written.append(path)
        digest, size = cache_files.write(path, arrays, {
            "fingerprint": layout.fingerprint, "hash": block, "n_tokens": str(BLOCK_TOKENS)})
        self.n_new += 1
        return cache_index.BlockRow(block, parent, BLOCK_TOKENS, str(path), size, digest)


def _insert(session: Session, agent: dict[str, Any], agent_id: str, plan: _Plan) -> tuple[int, int]:
    now = utcnow()
    # An archive's digests are not checked (they are the protocol's, per message): a
    # content-recognised agent would let a forged archive capture other clients' requests
    # that name no agent (history.find_by_content). Imported, it is reached by its id only.
    origin = "imported" if agent["origin"] == "content" else str(agent["origin"])
    conversations = [agents_store.ArchivedConversation(
        conversation_id, conversation["system_digest"], conversation["snapshot"], conversation["thread"],
        _parse(conversation["created_at"]), _parse(conversation["last_access_at"]),
        tuple(agents_store.ArchivedMessage(int(m["position"]), str(m["role"]), m["content"], m["digest"],
                                           _parse(m["created_at"])) for m in conversation["messages"]))
        for conversation, conversation_id, _ in plan]
    agents_store.add_imported(session, agent_id, origin=origin, created_at=_parse(agent["created_at"]), now=now,
                              ttl_seconds=agent["ttl_seconds"], hot_ttl_seconds=agent["hot_ttl_seconds"],
                              status=str(agent["status"]), metadata=dict(agent["metadata"] or {}),
                              conversations=conversations)
    n_tokens = 0
    for _, conversation_id, caches in plan:
        for cache, record, record_checksum, rows in caches:
            cache_index.save_cache(session, agent_id, conversation_id, str(cache["fingerprint"]),
                                   int(cache["n_tokens"]), str(record), rows, now, record_checksum=record_checksum)
            n_tokens += int(cache["n_tokens"])
    return sum(len(c.messages) for c in conversations), n_tokens


def _link_requests(session: Session, plan: _Plan, requests: frozenset[str]) -> None:
    """Point each imported message to the request that wrote it, if that request was imported."""
    for conversation, conversation_id, _ in plan:
        agents_store.link_requests(session, conversation_id, {
            int(m["position"]): m["request_id"] for m in conversation["messages"]
            if m.get("request_id") in requests})


def _parse(value: Any) -> datetime:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError as exc:
        raise InvalidRequest(f"archive: {value!r} is not a time", "archive") from exc


def _upload(tier: S3Tier, root: Path, plan: _Plan) -> None:
    """Copy the imported files to the pool's shared tier (blocks first, records last). A tier
    that is down only costs the other servers a cold first turn."""
    try:
        for _, _, caches in plan:
            for cache, record, _, rows in caches:
                # A block this home held already may be another server's file: missing here, skipped.
                layout = CacheFiles(root, str(cache["fingerprint"]), tier)
                upload_conversation(tier, layout.upload([layout.local(row.path, fetch=False) for row in rows], record))
    except Exception as exc:
        log.warning("shared tier: the imported agent's files were not uploaded (%s)", exc)
