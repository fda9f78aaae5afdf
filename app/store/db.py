"""Database engine, sessions and schema migration (SQLite in WAL mode)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.errors import ConfigError, StoreBusy

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 10.0
T = TypeVar("T")
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def make_engine(url: str, busy_timeout_s: float = BUSY_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An engine whose every connection uses WAL, foreign keys and a busy timeout.

    ``kwargs`` go to ``sqlalchemy.create_engine`` (e.g. ``poolclass``).
    """
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s}, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        # FULL: a commit (a turn's history) is on disk when it returns, power loss included;
        # NORMAL in WAL mode leaves the last commits in the page cache. ~0.3 ms a commit here.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def write_locked(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A transaction that holds SQLite's write lock from its start (BEGIN IMMEDIATE), so
    nothing it reads can change before it commits. Cache files are created and deleted
    by different processes (server, worker); each checks the rows and the files under
    this lock (``Persister``, ``jobs.delete_unreferenced``)."""
    with sessions.begin() as session:
        session.connection().exec_driver_sql("BEGIN IMMEDIATE")
        yield session


def is_locked(exc: OperationalError) -> bool:
    """SQLite's "database is locked" / "database is busy": another connection held the
    write lock past the busy timeout."""
    return "locked" in str(exc.orig) or "busy" in str(exc.orig)


def with_retries(write: Callable[[], T], attempts: int, backoff_s: float = 0.1) -> T:
    """Run the transaction ``write``; when the database stays locked past the busy
    timeout, run it again up to ``attempts`` times in all, waiting longer each time.

    Raises:
        StoreBusy: still locked after the last attempt.
    """
    for attempt in range(attempts):
        try:
            return write()
        except OperationalError as exc:
            if not is_locked(exc):
                raise
            log.warning("database locked (attempt %d of %d): %s", attempt + 1, attempts, exc.orig)
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2**attempt)
    raise StoreBusy("the database is busy (locked by another writer); retry shortly")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url)
    return config


def upgrade(url: str) -> None:
    """Bring the schema to the newest revision, refusing a database that is newer.

    Raises:
        ConfigError: the database carries a revision this code does not know
            (it was migrated by a newer Semantic).
    """
    config = alembic_config(url)
    scripts = ScriptDirectory.from_config(config)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_heads()
    finally:
        engine.dispose()
    for revision in current:
        if not _known(scripts, revision):
            raise ConfigError(
                f"database schema revision {revision} is newer than this version of "
                "Semantic understands; upgrade Semantic or point SEMANTIC_HOME elsewhere"
            )
    command.upgrade(config, "head")


def _known(scripts: ScriptDirectory, revision: str) -> bool:
    try:
        return scripts.get_revision(revision) is not None
    except CommandError:
        return False
