"""Alembic environment: the schema is app.store.models.Base.metadata.

The URL comes from the caller (``app.store.db.upgrade``), else ``-x url=...``,
else the effective Semantic settings.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import event, pool

from app.settings import load_settings
from app.store.db import is_postgres, make_engine
from app.store.models import Base

target_metadata = Base.metadata
config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    return (
        config.get_main_option("sqlalchemy.url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or load_settings().db_url
    )


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Every step and the foreign-key check in one transaction, so rows that would break a
    foreign key roll the whole migration back.

    PostgreSQL's DDL is transactional and checks foreign keys as it goes. SQLite needs
    help: foreign keys are off while migrating, because a batch rebuild drops and
    recreates a table, and with them on, dropping it would cascade into every table that
    references it (messages, caches); they are checked at the end instead. pysqlite would
    commit each DDL statement as it runs; with its own transaction handling off, the
    BEGIN is ours and SQLite's DDL is transactional.
    """
    engine = make_engine(_url(), poolclass=pool.NullPool)
    sqlite = not is_postgres(engine)
    if sqlite:
        @event.listens_for(engine, "connect")
        def _migrating(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # before any transaction: inside one it is ignored
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _begin(connection) -> None:  # type: ignore[no-untyped-def]
            connection.exec_driver_sql("BEGIN")

    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=sqlite, transactional_ddl=True)
        with context.begin_transaction():
            context.run_migrations()
            problems = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall() if sqlite else []
            if problems:
                raise RuntimeError(f"migration left rows that break foreign keys: {problems[:10]}")
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
