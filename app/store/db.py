"""Database engine, sessions and schema migration: SQLite in WAL mode (one server, the
default) or PostgreSQL (a pool of servers sharing one store), one schema for both."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from app.errors import ConfigError, StoreBusy
from app.redaction import redact

if TYPE_CHECKING:  # alembic is imported where a migration may run: a start at head needs none of it
    from alembic.config import Config
    from alembic.script import ScriptDirectory

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 10.0
# PostgreSQL: the advisory lock every write_locked transaction takes (any constant that
# nothing else in the database uses), and the SQLSTATEs a retry can cure.
WRITE_LOCK_KEY = 0x53454D41  # "SEMA"
PG_RETRYABLE = {"55P03", "40001", "40P01"}  # lock_not_available, serialization_failure, deadlock_detected
T = TypeVar("T")
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def database_url(url: str) -> str:
    """``url`` with the driver SQLAlchemy should use: psycopg 3 for PostgreSQL.

    Raises:
        ConfigError: neither SQLite nor PostgreSQL.
    """
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url.removeprefix(prefix)
    if url.startswith(("sqlite:///", "postgresql+psycopg://")):
        return url
    raise ConfigError(f"database_url: {redact(url)!r} is neither sqlite:///PATH nor postgresql://...")


def libpq_dsn(url: str) -> str:
    """A PostgreSQL URL as libpq connection parameters (for psycopg and Huey's ``PostgresHuey``)."""
    from psycopg.conninfo import make_conninfo

    target = make_url(database_url(url))
    given = {"host": target.host, "port": target.port, "user": target.username, "password": target.password,
             "dbname": target.database, **dict(target.query)}
    params: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    return make_conninfo("", **params)


def make_engine(url: str, busy_timeout_s: float = BUSY_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An engine whose connections wait at most ``busy_timeout_s`` for another writer's
    lock. SQLite: WAL, foreign keys and full synchronous commits on every connection.

    ``kwargs`` go to ``sqlalchemy.create_engine`` (e.g. ``poolclass``).
    """
    url = database_url(url)
    if is_postgres_url(url):
        timeout_ms = int(busy_timeout_s * 1000)
        # A database cut off by the network (a partition: its packets dropped, no reset) fails a
        # query on an open connection after ``busy_timeout_s`` as it fails a new one: without
        # tcp_user_timeout the kernel retransmits for ~15 minutes, and every request (health
        # checks too) waits that long instead of answering 503 (tests/e2e/test_pool_hosts.py).
        return create_engine(url, pool_pre_ping=True, connect_args={
            "connect_timeout": max(1, round(busy_timeout_s)), "tcp_user_timeout": timeout_ms,
            "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 5, "keepalives_count": 3,
            "options": f"-c lock_timeout={timeout_ms} -c idle_in_transaction_session_timeout=600000"},
            **kwargs)
    Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s}, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        # FULL: a commit (a turn's history) is on disk when it returns, power loss included;
        # NORMAL in WAL mode leaves the last commits in the page cache. A commit is small
        # (a turn's rows), so the fsync it waits for is too.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    return engine


def is_postgres_url(url: str) -> bool:
    return database_url(url).startswith("postgresql")


def is_postgres(bind: Engine | Connection | Session) -> bool:
    engine = bind.get_bind() if isinstance(bind, Session) else bind
    return engine.dialect.name == "postgresql"


def insert_or_ignore(session: Session, model: type[Any], **values: Any) -> None:
    """INSERT a row unless one with its key exists (another writer may insert it first)."""
    if is_postgres(session):
        from sqlalchemy.dialects.postgresql import insert  # a pool's store only: costly to import at every start

        session.execute(insert(model).values(**values).on_conflict_do_nothing())
    else:
        session.execute(sqlite_insert(model).values(**values).on_conflict_do_nothing())


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def write_locked(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A transaction that holds the store's write lock from its start, so nothing it reads
    can change before it commits. Cache files are created and deleted by different
    processes (servers, worker); each checks the rows and the files under this lock
    (``cache.persist.Persister``, ``cache.upkeep.delete_unreferenced``). SQLite: BEGIN IMMEDIATE (its one write
    lock); PostgreSQL: a transaction-level advisory lock that every such writer takes."""
    with sessions.begin() as session:
        if is_postgres(session):
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": WRITE_LOCK_KEY})
        else:
            session.connection().exec_driver_sql("BEGIN IMMEDIATE")
        yield session


def is_locked(exc: OperationalError) -> bool:
    """Another connection held a lock past the busy timeout: SQLite's "database is
    locked" / "busy", PostgreSQL's lock timeout, serialization failure or deadlock."""
    if getattr(exc.orig, "sqlstate", None) in PG_RETRYABLE:
        return True
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
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url)
    return config


def upgrade(url: str) -> None:
    """Bring the schema to the newest revision, refusing a database that is newer. A database
    whose ``alembic_version`` is the newest revision already (``at_head``) is left as it is
    without loading Alembic, whose import is a visible part of a server's start
    (benchmarks/boot.py).

    Raises:
        ConfigError: the database carries a revision this code does not know
            (it was migrated by a newer Semantic).
    """
    if at_head(url):
        return
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

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
    from alembic.util import CommandError

    try:
        return scripts.get_revision(revision) is not None
    except CommandError:
        return False


_REVISION = re.compile(r"""^revision\s*(?::[^=\n]*)?=\s*["']([^"'\n]+)["']\s*$""", re.MULTILINE)
_DOWN_REVISION = re.compile(r"""^down_revision\s*(?::[^=\n]*)?=\s*(?:["']([^"'\n]+)["']|None)\s*$""", re.MULTILINE)


def head_revision() -> str | None:
    """The newest revision in ``migrations/versions``, read from each file's ``revision`` and
    ``down_revision`` lines without Alembic: the one revision no other one follows. None where
    the files do not say one head plainly (a merge's tuple, a line this does not read, two
    heads): Alembic decides then."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        source = path.read_text()
        revision, down = _REVISION.findall(source), _DOWN_REVISION.findall(source)
        if len(revision) != 1 or len(down) != 1:
            return None
        revisions.add(revision[0])
        parents.update(down[0:1] if down[0] else [])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 and parents <= revisions else None


def at_head(url: str) -> bool:
    """Whether the database's ``alembic_version`` holds exactly the newest revision
    (``head_revision``); False where it holds anything else, nothing, or cannot be read."""
    head = head_revision()
    if head is None:
        return False
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = list(connection.execute(text("SELECT version_num FROM alembic_version")).scalars())
    except SQLAlchemyError:  # no such table yet (a new database): Alembic creates it
        return False
    finally:
        engine.dispose()
    return current == [head]
