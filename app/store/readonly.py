"""Read-only SQL over the store, for operators (``semantic sql``).

Three locks: the file is opened read-only, ``PRAGMA query_only`` is on, and an
authorizer allows only reading (so ``ATTACH``, ``PRAGMA`` and writes are
refused even where SQLite would otherwise allow them). Functions come from an
allow-list: ``fts3_tokenizer`` (its one-argument form returns a heap address) and
``randomblob`` / ``zeroblob`` (gigabytes on request) are not on it. A statement
stops at a deadline (a recursive CTE runs until killed otherwise), no value may
exceed ``MAX_VALUE_BYTES``, and the rows returned are capped.

On PostgreSQL (pool mode) the statement runs alone (sent as one prepared statement:
no ``;``-chained second one) in a read-only transaction under a statement
timeout, with the privileges of the configured database user: give operators a role
that may only SELECT where that matters.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, NamedTuple

from app.errors import InvalidRequest

DEADLINE_S = 10.0
MAX_ROWS = 10_000
MAX_VALUE_BYTES = 16 * 1024 * 1024  # SQLite's own limit on one string or blob is 1 GB
MAX_RESULT_BYTES = 64 * 1024 * 1024

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
FUNCTIONS = frozenset("""
    abs avg changes char coalesce concat concat_ws count cume_dist date datetime dense_rank first_value
    format glob group_concat hex ifnull iif instr julianday lag last_value lead length like likelihood
    likely lower ltrim max min nth_value ntile nullif octet_length percent_rank printf quote random rank
    replace round row_number rtrim sign sqlite_version strftime string_agg substr substring sum time
    timediff total trim typeof unhex unicode unixepoch unlikely upper
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod
    pi pow power radians sin sinh sqrt tan tanh trunc
    json jsonb json_array json_array_length json_each json_error_position json_extract json_group_array
    json_group_object json_insert json_object json_patch json_quote json_remove json_replace json_set
    json_tree json_type json_valid -> ->>
""".split())


def _authorize(action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
    if action in _ALLOWED:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_OK if (arg2 or "").lower() in FUNCTIONS else sqlite3.SQLITE_DENY
    # json_each / json_tree declare their columns when first used, which SQLite checks as
    # an update of sqlite_master; the file is read-only and query_only is on regardless.
    if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


class Result(NamedTuple):
    columns: list[str]
    rows: list[tuple[Any, ...]]
    truncated: bool  # more rows than the cap, or more bytes


def run_readonly(db_path: Path, sql: str, *, deadline_s: float = DEADLINE_S, max_rows: int = MAX_ROWS,
                 max_bytes: int = MAX_RESULT_BYTES) -> Result:
    """Run one read-only statement; at most ``max_rows`` rows and about ``max_bytes``.

    Raises:
        InvalidRequest: the statement writes, attaches, changes settings, calls a function
            off the list, runs past ``deadline_s``, or is invalid.
    """
    if not db_path.exists():
        raise InvalidRequest(f"no database at {db_path} (start the server or worker once)")
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    deadline = time.monotonic() + deadline_s
    try:
        connection.execute("PRAGMA query_only = ON")
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        connection.set_authorizer(_authorize)
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        return _capped(connection.execute(sql), max_rows, max_bytes)
    except sqlite3.OperationalError as exc:
        if str(exc) == "interrupted":
            raise InvalidRequest(f"the statement ran past its deadline of {deadline_s:g} s") from None
        raise InvalidRequest(f"refused or invalid SQL: {exc}") from None
    except sqlite3.DataError as exc:  # a value over MAX_VALUE_BYTES
        raise InvalidRequest(f"refused: {exc} (values are capped at {MAX_VALUE_BYTES >> 20} MiB)") from None
    except sqlite3.Error as exc:
        raise InvalidRequest(f"refused or invalid SQL: {exc}") from None
    finally:
        connection.close()


def _capped(cursor: Any, max_rows: int, max_bytes: int) -> Result:
    columns = [d[0] for d in cursor.description or []]
    rows: list[tuple[Any, ...]] = []
    size = 0
    for row in cursor:
        size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)
        if len(rows) == max_rows or size > max_bytes:
            return Result(columns, rows, True)
        rows.append(tuple(row))
    return Result(columns, rows, False)


def run_readonly_postgres(url: str, sql: str, *, deadline_s: float = DEADLINE_S, max_rows: int = MAX_ROWS,
                          max_bytes: int = MAX_RESULT_BYTES) -> Result:
    """``run_readonly`` on a PostgreSQL store.

    Raises:
        InvalidRequest: the statement writes, runs past ``deadline_s``, or is invalid.
    """
    import psycopg

    from app.store.db import libpq_dsn

    try:
        connection = psycopg.connect(libpq_dsn(url), connect_timeout=10, options=(
            f"-c default_transaction_read_only=on -c statement_timeout={int(deadline_s * 1000)}"))
    except psycopg.OperationalError as exc:
        raise InvalidRequest(f"cannot reach the database: {exc}".strip()) from None
    try:
        with connection.transaction():
            # Prepared: PostgreSQL itself refuses a second statement (a COMMIT and a write after it).
            return _capped(connection.execute(sql.encode(), prepare=True), max_rows, max_bytes)
    except psycopg.errors.QueryCanceled:
        raise InvalidRequest(f"the statement ran past its deadline of {deadline_s:g} s") from None
    except psycopg.Error as exc:
        raise InvalidRequest(f"refused or invalid SQL: {str(exc).strip()}") from None
    finally:
        connection.close()


def format_table(columns: list[str], rows: list[tuple[Any, ...]], truncated: bool = False) -> str:
    """An aligned plain-text table."""
    cells = [columns] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    more = ", more not shown: narrow the query or add LIMIT" if truncated else ""
    return "\n".join(lines + [f"({len(rows)} row{'s' if len(rows) != 1 else ''}{more})"])
