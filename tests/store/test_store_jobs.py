"""Store-side job helpers on a real SQLite file (no model)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from app.store.db import make_engine
from app.store.jobs import _worth_vacuuming


def test_vacuum_only_when_a_quarter_of_the_file_is_free(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (v BLOB)")
        db.executemany("INSERT INTO t VALUES (?)", [(b"x" * 4000,) for _ in range(1000)])  # ~4 MB
    engine = make_engine(f"sqlite:///{path}")
    try:
        assert not _worth_vacuuming(engine)  # full pages: nothing to reclaim
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM t WHERE rowid % 2 = 0")  # half the pages free
        assert _worth_vacuuming(engine)
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute("VACUUM")
        assert not _worth_vacuuming(engine)
    finally:
        engine.dispose()


def _store(url: str):  # type: ignore[no-untyped-def]
    from app.store.db import make_session_factory, upgrade

    upgrade(url)
    return make_session_factory(make_engine(url))


def _file(path: Path) -> str:
    import numpy as np

    from app.cache import files as blockfiles

    blockfiles.write(path, {"x": np.arange(8, dtype=np.float32)}, {"kind": "test"})
    return str(path)


def test_compaction_retires_only_what_still_needs_a_damaged_file(tmp_path: Path, store_url: str) -> None:
    """A turn that replaced its record between compact's snapshot and its checksum read
    keeps its new files: the missing old record is not damage, and a damaged old record
    retires nothing once the row points elsewhere. A damaged current record still does."""
    from sqlalchemy import select

    from app.store import cache_index
    from app.clock import utcnow
    from app.store.history import ensure_conversation
    from app.cache.upkeep import _damaged_sample, _retire_damaged
    from app.store.models import Cache

    sessions = _store(store_url)
    root = tmp_path / "blocks"
    old, new = _file(root / "r-old.safetensors"), _file(root / "r-new.safetensors")
    with sessions.begin() as session:
        ensure_conversation(session, "c", "a", "direct", utcnow())
        cache_index.save_cache(session, "a", "c", "fp", 10, old, [], utcnow(), record_checksum=None)
        cache_id = session.scalar(select(Cache.id))
    with sessions() as session:  # compact's snapshot lists the old record ...
        Path(old).unlink()  # ... then the turn's new record replaced it
        checked, blocks, records = _damaged_sample(session, root, sample=10)
    assert (checked, blocks, records) == (1, [], [])

    with sessions.begin() as session:
        cache_index.save_cache(session, "a", "c", "fp", 20, new, [], utcnow(), record_checksum=None)
        assert _retire_damaged(session, [], [(cache_id, old)]) == (0, [])
    assert Path(new).exists()

    Path(new).write_bytes(b"\0" * 64)  # the current record really damaged
    with sessions() as session:
        _, _, records = _damaged_sample(session, root, sample=10)
    assert records == [(cache_id, new)]
    with sessions.begin() as session:
        assert _retire_damaged(session, [], records)[0] == 1
        assert session.scalar(select(Cache.tier)) == "cold"


def test_files_that_vanish_during_a_scan_do_not_abort_it(tmp_path: Path, store_url: str) -> None:
    """A dangling link is a file rglob lists and stat() cannot find, as one deleted
    between the listing and the stat."""
    from app.cache.upkeep import orphan_files, remove_stale_temp_files

    sessions = _store(store_url)
    root = tmp_path / "blocks"
    root.mkdir()
    (root / "gone.safetensors.tmp").symlink_to(root / "nowhere")
    (root / "gone.safetensors").symlink_to(root / "nowhere")
    assert remove_stale_temp_files(root, now_s=1e12) == []
    with sessions() as session:
        assert orphan_files(session, root, now_s=1e12) == []


def test_prune_keeps_history_and_recent_rows(tmp_path: Path, store_url: str) -> None:
    """Old job runs and old request rows go; a request that a stored message points to stays."""
    from datetime import timedelta

    from sqlalchemy import select

    from app.clock import utcnow
    from app.store.history import StoredMessage, append_messages, ensure_conversation, start_request
    from app.store.jobs import record_run, run_prune
    from app.store.models import JobRun, Request

    sessions = _store(store_url)
    now, old = utcnow(), utcnow() - timedelta(days=40)
    with sessions.begin() as session:
        ensure_conversation(session, "c", "a", "direct", now)
        for request, at in (("old-with-history", old), ("old-refused", old), ("recent", now)):
            start_request(session, request, protocol="direct", model=None, served_model=None, stream=False,
                          n_input_tokens=None, now=at)
        append_messages(session, "a", "c", [StoredMessage("user", "hi", "d")], "old-with-history", old)
    record_run(sessions, "expire", old, old, {})
    record_run(sessions, "expire", now, now, {})
    result = run_prune(sessions, retention_days=30)
    assert (result["job_runs_deleted"], result["requests_deleted"]) == (1, 1)
    with sessions() as session:
        assert set(session.scalars(select(Request.id))) == {"old-with-history", "recent"}
        assert len(session.scalars(select(JobRun.id)).all()) == 2  # the recent run and prune's own


def test_compact_cleans_a_pools_server_directories_keeping_copies_of_named_files(tmp_path: Path,
                                                                                    store_url: str) -> None:
    """Rows name the writing server's paths; another server's copy of a named file (same key
    below its root) stays, a copy of a file no row names any more goes. Without
    ``more_dirs`` the servers' directories are not looked at."""
    import os

    from app.cache.upkeep import run_compact
    from app.store import cache_index
    from app.clock import utcnow
    from app.store.history import ensure_conversation

    sessions = _store(store_url)
    tag = "f" * 16
    writer = _file(tmp_path / "s1" / "blocks" / tag / "conversations" / "named.safetensors")
    copy = _file(tmp_path / "s2" / "blocks" / tag / "conversations" / "named.safetensors")
    stale = _file(tmp_path / "s2" / "blocks" / tag / "conversations" / "retired.safetensors")
    for path in (writer, copy, stale):
        os.utime(path, (1, 1))  # long past the grace period
    with sessions.begin() as session:
        ensure_conversation(session, "c", "a", "direct", utcnow())
        cache_index.save_cache(session, "a", "c", "f" * 64, 10, writer, [], utcnow(), record_checksum=None)
    engine = make_engine(store_url)
    try:
        run_compact(engine, sessions, tmp_path / "worker" / "blocks")
        assert Path(stale).exists()
        servers = [tmp_path / "s1" / "blocks", tmp_path / "s2" / "blocks"]
        assert run_compact(engine, sessions, tmp_path / "worker" / "blocks", more_dirs=servers)["orphan_files"] == 1
    finally:
        engine.dispose()
    assert Path(writer).exists() and Path(copy).exists() and not Path(stale).exists()
