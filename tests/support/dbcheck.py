"""Read the server's database from a test (read-only, by SQL)."""

from __future__ import annotations

import sqlite3
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
