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
