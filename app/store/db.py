"""Database engine, sessions and schema migration (SQLite in WAL mode)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from app.errors import ConfigError

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine whose every connection uses WAL, foreign keys and a busy timeout.

    ``kwargs`` go to ``sqlalchemy.create_engine`` (e.g. ``poolclass``).
    """
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000}, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


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
