"""What makes a committed turn survive power loss, not only a killed process."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from app.store.db import make_engine


def test_every_connection_commits_durably(tmp_path: Path) -> None:
    """synchronous=FULL (2): a WAL commit is fsynced before it returns; NORMAL (1) is not."""
    engine = make_engine(f"sqlite:///{tmp_path / 'semantic.db'}")
    try:
        for _ in range(2):  # a fresh connection each time
            with engine.connect() as connection:
                assert connection.execute(text("PRAGMA synchronous")).scalar() == 2
                assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            engine.dispose()
    finally:
        engine.dispose()
