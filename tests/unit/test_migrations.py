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


def _populate_at_0003(url: str) -> None:
    """Two agents with history, a cache with blocks and requests, as the 0003 schema stored them."""
    command.upgrade(alembic_config(url), "0003")
    engine = make_engine(url)
    now = "2026-11-01 10:00:00"
    with engine.begin() as c:
        for agent in ("a1", "a2"):
            c.execute(text("INSERT INTO agents (id, origin, created_at, last_access_at, status, metadata_json) "
                           "VALUES (:a, 'anthropic', :t, :t, 'active', '{}')"), {"a": agent, "t": now})
            c.execute(text("INSERT INTO requests (id, agent_id, protocol, stream, status, created_at, "
                           "n_input_tokens, n_cached_tokens) VALUES (:r, :a, 'anthropic', 0, 'ok', :t, 10, 5)"),
                      {"r": f"req-{agent}", "a": agent, "t": now})
            for position, role in enumerate(("user", "assistant")):
                c.execute(text("INSERT INTO messages (agent_id, position, role, content, created_at, request_id) "
                               "VALUES (:a, :p, :role, '\"hi\"', :t, :r)"),
                          {"a": agent, "p": position, "role": role, "t": now, "r": f"req-{agent}"})
        c.execute(text("INSERT INTO blocks (hash, model_fingerprint, n_tokens, path, nbytes, ref_count, tier, "
                       "created_at, last_access_at) VALUES ('b1', 'fp', 256, '/x', 10, 1, 'warm', :t, :t)"), {"t": now})
        c.execute(text("INSERT INTO caches (agent_id, model_fingerprint, n_tokens, tier, record_path, created_at, "
                       "updated_at, last_access_at) VALUES ('a1', 'fp', 300, 'warm', '/r', :t, :t, :t)"), {"t": now})
        c.execute(text("INSERT INTO cache_blocks (cache_id, position, block_hash) VALUES (1, 0, 'b1')"))
    engine.dispose()


def _count(url: str, sql: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return int(c.execute(text(sql)).scalar() or 0)
    finally:
        engine.dispose()


def test_populated_database_keeps_history_and_caches_across_0004_up_and_down(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _populate_at_0003(url)
    upgrade(url)
    assert _count(url, "SELECT count(*) FROM messages") == 4
    assert _count(url, "SELECT count(*) FROM conversations") == 2
    assert _count(url, "SELECT count(DISTINCT conversation_id) FROM messages") == 2
    assert _count(url, "SELECT count(*) FROM caches c JOIN conversations v ON v.id = c.conversation_id "
                       "WHERE v.agent_id = 'a1'") == 1
    assert _count(url, "SELECT count(*) FROM cache_blocks") == 1  # not cascaded away by the table rebuild
    assert _count(url, "SELECT count(*) FROM requests WHERE conversation_id IS NOT NULL") == 2
    assert _count(url, "SELECT turns FROM agent_turns WHERE agent_id = 'a1'") == 1
    assert _count(url, "SELECT turns FROM conversation_turns WHERE agent_id = 'a2'") == 1
    command.downgrade(alembic_config(url), "0003")
    assert _count(url, "SELECT count(*) FROM messages") == 4
    assert _count(url, "SELECT count(*) FROM cache_blocks") == 1
    assert _count(url, "SELECT max(position) FROM messages WHERE agent_id = 'a2'") == 1
    assert _count(url, "SELECT count(*) FROM agents") == 2
    command.downgrade(alembic_config(url), "0002")  # 0003's rebuild of agents cascades nothing either
    assert _count(url, "SELECT count(*) FROM messages") == 4
    assert _count(url, "SELECT count(*) FROM caches") == 1
