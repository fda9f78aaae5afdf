"""Read the server's database from a test (read-only, by SQL)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any


def query(db_path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        return connection.execute(sql, params).fetchall()
    finally:
        connection.close()


def request_row(db_path: Path, request_id: str) -> dict[str, Any]:
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    connection.row_factory = sqlite3.Row
    try:
        row = connection.execute("SELECT * FROM requests WHERE id = ?", (request_id,)).fetchone()
        return dict(row) if row else {}
    finally:
        connection.close()


def wait_persisted(db_path: Path, agent_id: str, n_tokens: int, timeout_s: float = 60) -> None:
    """Wait until the server has written ``agent_id``'s cache of at least ``n_tokens``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = query(db_path, "SELECT max(n_tokens) FROM caches WHERE agent_id = ?", agent_id)
        if rows and rows[0][0] is not None and rows[0][0] >= n_tokens:
            return
        time.sleep(0.1)
    raise AssertionError(f"the cache of {agent_id} was not persisted")
