"""The worker deletes cache files by path while the server may be taking the same
content-addressed block back for another conversation. Both interleavings, forced
deterministically on real files and real SQLite and PostgreSQL stores: no row ever points to a
missing file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from sqlalchemy import select

from app.cache.blocks import BLOCK_TOKENS, KVBlock
from app.cache.files import CacheFiles
from app.cache.persist import Persister, Snapshot
from app.cache.records import CacheRecord, ConversationCache
from app.store import cache_index
from app.store.db import make_engine, make_session_factory, upgrade
from app.cache.upkeep import delete_unreferenced
from app.clock import utcnow
from app.store.history import ensure_conversation
from app.store.models import Cache
from support.store_check import store_problems

BLOCK = "b" * 64


def block() -> KVBlock:
    return KVBlock(BLOCK_TOKENS, (tuple(mx.random.normal((1, 1, BLOCK_TOKENS, 4)) for _ in range(6)),))


def snapshot(conversation: str) -> Snapshot:
    record = CacheRecord(tuple(range(BLOCK_TOKENS)), "x" * BLOCK_TOKENS, tuple(range(1, BLOCK_TOKENS + 1)))
    return Snapshot(ConversationCache("agent", conversation, record, (BLOCK,), None), {BLOCK: block()})


@pytest.fixture
def store(tmp_path: Path, store_url: str) -> tuple[Any, CacheFiles, Persister]:
    url = store_url
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as session:  # the history writer's rows, made before a turn's cache is stored
        for conversation in ("c1", "c2"):
            ensure_conversation(session, conversation, "agent", "direct", utcnow())
    files = CacheFiles(tmp_path / "blocks", "f" * 64)
    return sessions, files, Persister(files, sessions)


def retire(sessions: Any, conversation: str) -> list[str]:
    """The evict job's row change: the cache goes cold, its unreferenced blocks' rows go."""
    with sessions.begin() as session:
        cache = session.scalars(select(Cache).where(Cache.conversation_id == conversation)).one()
        return cache_index.retire_cache(session, cache)


def test_a_block_taken_back_before_the_worker_deletes_it_is_kept(store, tmp_path: Path, store_url: str) -> None:  # type: ignore[no-untyped-def]
    sessions, files, persister = store
    persister._write(snapshot("c1"))
    doomed = retire(sessions, "c1")  # the worker commits: block row gone, file still there
    assert str(files.block_path(BLOCK)) in doomed
    persister._write(snapshot("c2"))  # the server finds the file and takes the block back
    delete_unreferenced(sessions, doomed)  # the worker's deletion comes after
    assert files.block_path(BLOCK).exists()
    assert store_problems(tmp_path, store_url) == []


def test_a_block_deleted_between_the_servers_check_and_its_commit_is_rewritten(store, tmp_path: Path, store_url: str) -> None:  # type: ignore[no-untyped-def]
    sessions, files, persister = store
    persister._write(snapshot("c1"))
    doomed = retire(sessions, "c1")
    write_block = files.write_block
    deletions = [doomed]

    def then_the_worker_deletes(block_id: str, data: KVBlock, indexed: str | None = None) -> tuple[Path, str]:
        found = write_block(block_id, data, indexed)  # first time: the file exists, it is not written again
        if deletions:  # ... and the worker deletes it right after, once
            delete_unreferenced(sessions, deletions.pop())
            assert not files.block_path(BLOCK).exists()
        return found

    files.write_block = then_the_worker_deletes  # type: ignore[method-assign]
    persister._write(snapshot("c2"))
    assert files.block_path(BLOCK).exists()
    assert store_problems(tmp_path, store_url) == []


def test_a_full_write_queue_makes_the_submitter_wait_instead_of_growing(store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from app.cache import persist
    from app.cache.persist import Forget

    sessions, files, _ = store
    monkeypatch.setattr(persist, "MAX_QUEUED", 4)
    persister = Persister(files, sessions)
    disk = threading.Event()  # the disk is stuck until set
    monkeypatch.setattr(persister, "_forget", lambda _conversation: disk.wait(30))
    persister.start()
    submitted: list[threading.Event] = []
    submitter = threading.Thread(target=lambda: submitted.extend(persister.submit(Forget(f"c{i}")) for i in range(8)))
    submitter.start()
    submitter.join(1)
    assert submitter.is_alive()  # 1 being written, 4 queued: the rest wait for room
    assert persister._queue.qsize() == 4
    disk.set()
    submitter.join(30)
    assert not submitter.is_alive() and persister.flush(30) and all(done.is_set() for done in submitted)
    persister.stop()
