"""Alembic migrations on a real SQLite file: upgrade, compare, downgrade."""

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from app.errors import ConfigError
from app.store.db import alembic_config, make_engine, upgrade
from app.store.models import Base

import pytest


def test_upgrade_matches_models_and_downgrade_round_trips(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
    tables = set(inspect(engine).get_table_names())
    assert {"agents", "messages", "requests", "caches", "blocks", "cache_blocks", "job_runs"} <= tables
    engine.dispose()

    command.downgrade(alembic_config(url), "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(url)  # and back up again


def test_upgrade_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    upgrade(url)


def test_database_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffff_future'"))
    engine.dispose()
    with pytest.raises(ConfigError, match="newer than this version"):
        upgrade(url)
