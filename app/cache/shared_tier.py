"""The shared block tier of a pool: an S3-compatible object store every server reads.

Cache files keep their local layout as object keys (``<fingerprint[:16]>/<hash[:2]>/<hash>.safetensors``
for blocks, ``<fingerprint[:16]>/conversations/<name>.safetensors`` for records), under a
prefix. Blocks are content-addressed and written once (``If-None-Match: *``); a record
is a new object for every version, uploaded after its blocks, so a record in the store
means its blocks are there too. Any server restores a conversation from here when its own
disk lacks the files; what it reads is verified against the checksums in the index.

``block_store = "s3://bucket/prefix?endpoint=http://host:port"``; credentials and region
come from the usual AWS variables (``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from app.cache import durable
from app.errors import ConfigError
from app.redaction import redact

log = logging.getLogger(__name__)

# A block this server put in the tier (or found there) is taken to be there for this long,
# then asked for again (a HEAD: no body sent) and put only if the tier lost it, which it
# gets back from the next turn that uses it. At most this many keys are remembered.
UPLOADED_MEMO_S = 60.0
UPLOADED_MEMO_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str
    endpoint: str | None


def parse_block_store(url: str) -> S3Location:
    """``s3://bucket[/prefix][?endpoint=URL]``.

    Raises:
        ConfigError: another scheme, or no bucket.
    """
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"block_store: {redact(url)!r} is not s3://bucket[/prefix][?endpoint=URL]")
    endpoint = parse_qs(parsed.query).get("endpoint", [None])[0]
    return S3Location(parsed.netloc, parsed.path.strip("/"), endpoint)


class S3Tier:
    """Objects in one bucket under one prefix, through boto3."""

    def __init__(self, url: str, timeout_s: float = 10) -> None:
        import boto3
        from botocore.config import Config

        self.location = parse_block_store(url)
        # A session of its own: boto3's default one keeps the first credentials it found.
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=self.location.endpoint,
            region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=timeout_s, read_timeout=timeout_s,
                          retries={"max_attempts": 2, "mode": "standard"}))

    def _key(self, key: str) -> str:
        return f"{self.location.prefix}/{key}" if self.location.prefix else key

    def put(self, key: str, path: Path, once: bool = False) -> bool:
        """Upload ``path`` as ``key``; ``once``: only if no object has the key (content-addressed
        blocks). Returns whether it was written (False: it was already there)."""
        from botocore.exceptions import ClientError

        extra = {"IfNoneMatch": "*"} if once else {}
        try:
            with path.open("rb") as body:
                self._client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=body, **extra)
        except ClientError as exc:
            if once and exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return False
            raise
        return True

    def fetch(self, key: str, destination: Path) -> bool:
        """Download ``key`` to ``destination`` (written whole, then renamed into place).
        Returns False when there is no such object.

        One GET, streamed (boto3's ``download_file`` adds a HEAD and a thread pool: a
        failover's restore waits on these). The copy is not fsynced: it is a copy of the
        tier, and one a power cut damages fails its checksum, is quarantined and fetched again."""
        from botocore.exceptions import ClientError

        durable.make_directories(destination.parent)
        try:
            response = self._client.get_object(Bucket=self.location.bucket, Key=self._key(key))
        except ClientError as exc:
            if _missing(exc):
                return False
            raise
        partial = destination.with_name(f"{destination.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with partial.open("wb") as out:
                for chunk in response["Body"].iter_chunks(1 << 20):
                    out.write(chunk)
            os.replace(partial, destination)
        finally:
            partial.unlink(missing_ok=True)
        return True

    def _head(self, key: str) -> dict | None:
        """The object's HEAD answer, or None when there is no such object. Raises what boto3
        raises when the store does not answer."""
        from botocore.exceptions import ClientError

        try:
            return dict(self._client.head_object(Bucket=self.location.bucket, Key=self._key(key)))
        except ClientError as exc:
            if _missing(exc):
                return None
            raise

    def holds(self, key: str) -> bool:
        """Whether an object has the key (one HEAD). Raises what boto3 raises when the store
        does not answer."""
        return self._head(key) is not None

    def holds_copy(self, key: str, path: Path) -> bool:
        """Whether the object ``key`` has the bytes of the local file ``path``: its ETag (one
        HEAD) is the MD5 of a single-part put's bytes (``put`` makes those), compared to the
        file's; any other ETag (a multipart upload's) is checked by reading the object. A HEAD
        alone proves a key, not a readable copy. Raises what boto3 raises when the store does
        not answer, OSError when the file cannot be read."""
        head = self._head(key)
        if head is None:
            return False
        local = _md5(path.open("rb"))
        etag = str(head.get("ETag", "")).strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag):
            same = etag == local
        else:
            same = _md5(self._client.get_object(Bucket=self.location.bucket, Key=self._key(key))["Body"]) == local
        if not same:
            log.warning("the shared tier's %s differs from this host's copy", key)
        return same

    def listing(self) -> Iterator[tuple[str, datetime]]:
        """Every object under the prefix: (key below the prefix, when it was last written)."""
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, **({"Prefix": f"{self.location.prefix}/"} if self.location.prefix else {}))
        start = len(self.location.prefix) + 1 if self.location.prefix else 0
        for page in pages:
            for item in page.get("Contents", []):
                yield item["Key"][start:], item["LastModified"]

    def delete(self, keys: list[str]) -> int:
        """Delete objects (1,000 a request); returns how many the store deleted."""
        deleted = 0
        for start in range(0, len(keys), 1000):
            answer = self._client.delete_objects(Bucket=self.location.bucket, Delete={
                "Objects": [{"Key": self._key(k)} for k in keys[start:start + 1000]], "Quiet": False})
            deleted += len(answer.get("Deleted", []))
        return deleted

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (a local pool's own store)."""
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.location.bucket)
        except ClientError:
            self._client.create_bucket(Bucket=self.location.bucket)


@dataclass(frozen=True, slots=True)
class Upload:
    """A conversation's files to copy to the tier: its blocks (written once), then its record."""

    blocks: tuple[tuple[str, Path], ...]
    record: tuple[str, Path]


class UploadMemo:
    """Block keys seen in the tier, and when (oldest first): skipped for ``memo_s``, then put
    again, since the tier may lose an object (blocks never change, so a put is a no-op while
    it holds one). Bounded: the oldest beyond ``memo_keys`` are forgotten."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, memo_s: float = UPLOADED_MEMO_S,
                 memo_keys: int = UPLOADED_MEMO_KEYS) -> None:
        self._uploaded: OrderedDict[str, float] = OrderedDict()
        self._clock = clock
        self._memo_s = memo_s
        self._memo_keys = memo_keys

    def known(self, key: str) -> bool:
        """Whether the block was seen in the tier recently enough to skip putting it."""
        seen = self._uploaded.get(key)
        return seen is not None and self._clock() - seen < self._memo_s

    def seen(self, key: str) -> bool:
        """Whether the block was ever seen in the tier (however long ago, while remembered)."""
        return key in self._uploaded

    def remember(self, key: str) -> None:
        self._uploaded[key] = self._clock()
        self._uploaded.move_to_end(key)
        while len(self._uploaded) > self._memo_keys:
            self._uploaded.popitem(last=False)


def upload_conversation(tier: S3Tier, upload: Upload, memo: UploadMemo | None = None) -> None:
    """Put a conversation's files in the tier: each block once (``If-None-Match``; skipped
    while ``memo`` has seen it in the tier recently, asked for with a HEAD and put only if
    lost once it saw it longer ago; one gone from this disk since is skipped: the janitor
    saw the tier hold it, or its row went), then the record, last: a record in the tier
    means its blocks are there. The one upload path of the persister's turns and fork
    copies (through ``Uploader``) and of an agent's import.

    Raises:
        Whatever the tier raises (it is down or refused): the caller decides what a failed
        upload costs.
    """
    for key, path in upload.blocks:
        if memo is not None and memo.known(key):
            continue
        try:
            if not (memo is not None and memo.seen(key) and tier.holds(key)):
                tier.put(key, path, once=True)
        except FileNotFoundError:
            continue
        if memo is not None:
            memo.remember(key)
    tier.put(*upload.record)


class Uploader(threading.Thread):
    """Copies what the persister wrote to the shared tier, in order, off every request's path.

    An upload that fails (the store is down) is dropped with a warning: the conversation's
    next turn uploads its blocks and record again, so the tier catches up when it returns.
    """

    def __init__(self, tier: S3Tier, clock: Callable[[], float] = time.monotonic,
                 memo_s: float = UPLOADED_MEMO_S, memo_keys: int = UPLOADED_MEMO_KEYS) -> None:
        super().__init__(name="semantic-upload", daemon=True)
        self._tier = tier
        self._queue: queue.Queue[Upload | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._memo = UploadMemo(clock, memo_s, memo_keys)
        self.n_failed = 0

    def submit(self, upload: Upload) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(upload)

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def stop(self, timeout_s: float = 30) -> bool:
        """Upload what is queued, then stop, within ``timeout_s``: False, with a warning naming
        the uploads left, if the tier does not keep up (the next turns upload again)."""
        self._queue.put(None)  # unbounded: never waits
        self.join(timeout_s)
        if self.is_alive():
            with self._idle:
                left = self._pending
            log.warning("shared tier: %d upload(s) not done after %.0f s: stopping without them", left, timeout_s)
            return False
        return True

    def run(self) -> None:
        while (upload := self._queue.get()) is not None:
            try:
                upload_conversation(self._tier, upload, self._memo)
            except Exception as exc:  # the tier is down or refused: the next turn uploads again
                self.n_failed += 1
                log.warning("shared tier: upload of %s failed (%s); the next turn retries", upload.record[0], exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


def _md5(stream: Any) -> str:
    """The MD5 of what a binary stream holds (read in 1 MiB pieces, then closed): S3's ETag
    of a single-part put, not a security check."""
    digest = hashlib.md5(usedforsecurity=False)
    with closing(stream):
        while piece := stream.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def _missing(exc: Any) -> bool:
    """Whether a boto3 ClientError says the object does not exist."""
    return exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")
