"""Read-only SQL over the store, for operators (``semantic sql``).

Three locks: the file is opened read-only, ``PRAGMA query_only`` is on, and an
authorizer allows only reading (so ``ATTACH``, ``PRAGMA`` and writes are
refused even where SQLite would otherwise allow them).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from app.errors import InvalidRequest

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def run_readonly(db_path: Path, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only statement.

    Returns:
        Column names and rows.

    Raises:
        InvalidRequest: the statement writes, attaches, changes settings, or is invalid.
    """
    if not db_path.exists():
        raise InvalidRequest(f"no database at {db_path} (start the server or worker once)")
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        connection.execute("PRAGMA query_only = ON")
        connection.set_authorizer(_authorize)
        cursor = connection.execute(sql)
        columns = [d[0] for d in cursor.description or []]
        return columns, cursor.fetchall()
    except sqlite3.Error as exc:
        raise InvalidRequest(f"refused or invalid SQL: {exc}") from None
    finally:
        connection.close()


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """An aligned plain-text table."""
    cells = [columns] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"({len(rows)} row{'s' if len(rows) != 1 else ''})"])
