"""The wall clock the store's rows are stamped with: one home for "now" (naive UTC).

Rows hold naive UTC datetimes (SQLite keeps no time zone); every module that stamps a
row, or compares a row's time with now, reads this clock.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, in UTC, without a time zone (as the store's columns hold it)."""
    return datetime.now(UTC).replace(tzinfo=None)
