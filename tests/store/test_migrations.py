"""Alembic migrations on a real SQLite file and a real PostgreSQL database: upgrade, compare, downgrade."""

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from app.errors import ConfigError
from app.store.db import alembic_config, at_head, head_revision, make_engine, upgrade
from app.store.models import Base

import pytest


def test_upgrade_matches_models_and_downgrade_round_trips(store_url: str) -> None:
    url = store_url
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        if url.startswith("sqlite"):
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


def test_upgrade_is_idempotent(store_url: str) -> None:
    url = store_url
    upgrade(url)
    upgrade(url)  # a second start changes nothing: still at head, the schema still the models'
    engine = make_engine(url)
    with engine.connect() as connection:
        heads = ScriptDirectory.from_config(alembic_config(url)).get_heads()
        assert [connection.execute(text("SELECT version_num FROM alembic_version")).scalar()] == heads
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    engine.dispose()


def test_database_from_a_newer_version_is_refused(store_url: str) -> None:
    url = store_url
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
                           "n_input_tokens, n_cached_tokens) VALUES (:r, :a, 'anthropic', false, 'ok', :t, 10, 5)"),
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


def test_populated_database_keeps_history_and_caches_across_0004_up_and_down(store_url: str) -> None:
    url = store_url
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


def _populate_at_head_with_two_conversations_per_agent(url: str) -> None:
    """Agent a1: conversations c1 (older) and c2 (newer), each with a cache; both caches list
    the shared block b0, c2's also b2; c1 holds two messages, c2 three. Agent a2: two caches used at the same instant (a tie)."""
    upgrade(url)
    engine = make_engine(url)
    old, new = "2026-11-01 10:00:00", "2026-11-02 10:00:00"
    with engine.begin() as c:
        def run(sql: str, **values: object) -> None:
            c.execute(text(sql), values)

        for agent in ("a1", "a2"):
            run("INSERT INTO agents (id, origin, created_at, last_access_at, status, metadata_json) "
                "VALUES (:a, 'anthropic', :t, :t, 'active', '{}')", a=agent, t=old)
        for conv, agent, at in (("c1", "a1", old), ("c2", "a1", new), ("c3", "a2", old), ("c4", "a2", old)):
            run("INSERT INTO conversations (id, agent_id, created_at, last_access_at) VALUES (:c, :a, :t, :t)",
                c=conv, a=agent, t=at)
            run("INSERT INTO caches (agent_id, conversation_id, model_fingerprint, n_tokens, tier, record_path, "
                "created_at, updated_at, last_access_at) VALUES (:a, :c, 'fp', 300, 'warm', :r, :t, :t, :t)",
                a=agent, c=conv, r=f"/{conv}", t=at)
        for conv, n in (("c1", 2), ("c2", 3)):  # positions shift on the way down: c2's become 2..4
            for position in range(n):
                run("INSERT INTO messages (agent_id, conversation_id, position, role, content, created_at) "
                    "VALUES ('a1', :c, :p, 'user', '\"hi\"', :t)", c=conv, p=position, t=old)
        for block in ("b0", "b2"):
            run("INSERT INTO blocks (hash, model_fingerprint, n_tokens, path, nbytes, ref_count, tier, created_at, "
                "last_access_at) VALUES (:b, 'fp', 256, :p, 10, 0, 'warm', :t, :t)", b=block, p=f"/{block}", t=old)
        for cache_id, position, block in ((1, 0, "b0"), (2, 0, "b0"), (2, 1, "b2"), (3, 0, "b0"), (4, 0, "b0")):
            run("INSERT INTO cache_blocks (cache_id, position, block_hash) VALUES (:c, :p, :b)",
                c=cache_id, p=position, b=block)
        run("UPDATE blocks SET ref_count = (SELECT count(*) FROM cache_blocks WHERE block_hash = blocks.hash)")
    engine.dispose()


def test_0004_downgrade_keeps_one_cache_per_agent_and_its_blocks_consistent(store_url: str) -> None:
    url = store_url
    _populate_at_head_with_two_conversations_per_agent(url)
    command.downgrade(alembic_config(url), "0003")
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            kept = c.execute(text("SELECT agent_id, record_path FROM caches ORDER BY agent_id")).fetchall()
            lists = c.execute(text("SELECT cache_id, block_hash FROM cache_blocks ORDER BY cache_id, position"))
            counts = dict(c.execute(text("SELECT hash, ref_count FROM blocks")).fetchall())
            broken = c.execute(text("PRAGMA foreign_key_check")).fetchall() if url.startswith("sqlite") else []
            ids = {row[0] for row in c.execute(text("SELECT id FROM caches"))}
            listed = lists.fetchall()
            positions = [row[0] for row in c.execute(text("SELECT position FROM messages ORDER BY position"))]
    finally:
        engine.dispose()
    assert kept == [("a1", "/c2"), ("a2", "/c4")]  # the newer one; a tie goes to the newer row
    assert {cache for cache, _ in listed} <= ids and len(listed) == 3
    assert counts == {"b0": 2, "b2": 1} and broken == []
    assert positions == [0, 1, 2, 3, 4]


def test_a_migration_that_breaks_a_foreign_key_is_rolled_back(tmp_path: Path) -> None:
    """The check runs inside the migration's transaction: a failure keeps the old version."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as c:
        c.exec_driver_sql("PRAGMA foreign_keys=OFF")
        c.execute(text("INSERT INTO cache_blocks (cache_id, position, block_hash) VALUES (99, 0, 'nowhere')"))
        c.commit()
    engine.dispose()
    with pytest.raises(RuntimeError, match="break foreign keys"):
        command.downgrade(alembic_config(url), "0004")
    assert _count(url, "SELECT count(*) FROM responses") == 0  # 0005's table is still there


def _rows(url: str, sql: str) -> list[tuple]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return [tuple(row) for row in c.execute(text(sql))]
    finally:
        engine.dispose()


def test_0007_keeps_how_reuse_ended_in_reuse_reason_alone_and_drops_messages_n_tokens(store_url: str) -> None:
    """A row from before 0004 has only match_outcome: it moves into reuse_reason; the
    cache_misses view reads on; the way down writes match_outcome back in its own words.
    messages.n_tokens goes, the messages stay."""
    url = store_url
    command.upgrade(alembic_config(url), "0006")
    engine = make_engine(url)
    with engine.begin() as c:
        now = "2026-11-01 10:00:00"
        c.execute(text("INSERT INTO agents (id, origin, created_at, last_access_at, status, metadata_json) "
                       "VALUES ('a', 'direct', :t, :t, 'active', '{}')"), {"t": now})
        c.execute(text("INSERT INTO conversations (id, agent_id, created_at, last_access_at) "
                       "VALUES ('c', 'a', :t, :t)"), {"t": now})
        c.execute(text("INSERT INTO messages (agent_id, conversation_id, position, role, content, created_at, "
                       "n_tokens) VALUES ('a', 'c', 0, 'user', '\"hi\"', :t, NULL)"), {"t": now})
        for request_id, outcome, reason in (("old", "diverge", None), ("sib", "shared", "sibling"),
                                             ("off", "miss", "off"), ("ext", "extend", "extend")):
            c.execute(text("INSERT INTO requests (id, protocol, stream, status, created_at, match_outcome, "
                           "reuse_reason) VALUES (:r, 'openai', false, 'ok', '2026-11-01 10:00:00', :o, :m)"),
                      {"r": request_id, "o": outcome, "m": reason})
    engine.dispose()
    upgrade(url)
    engine = make_engine(url)
    assert "match_outcome" not in {c["name"] for c in inspect(engine).get_columns("requests")}
    assert "n_tokens" not in {c["name"] for c in inspect(engine).get_columns("messages")}
    engine.dispose()
    assert _rows(url, "SELECT conversation_id, position, role FROM messages") == [("c", 0, "user")]
    assert dict(_rows(url, "SELECT id, reuse_reason FROM requests")) == {
        "old": "diverge", "sib": "sibling", "off": "off", "ext": "extend"}
    assert _rows(url, "SELECT request_id, reuse_reason FROM cache_misses ORDER BY request_id") == [
        ("off", "off"), ("old", "diverge"), ("sib", "sibling")]
    command.downgrade(alembic_config(url), "0006")
    assert dict(_rows(url, "SELECT id, match_outcome FROM requests")) == {
        "old": "diverge", "sib": "shared", "off": "miss", "ext": "extend"}
    assert _rows(url, "SELECT request_id, match_outcome FROM cache_misses ORDER BY request_id") == [
        ("off", "miss"), ("old", "diverge"), ("sib", "shared")]
    assert _rows(url, "SELECT position, n_tokens FROM messages") == [(0, None)]


def test_the_head_read_from_the_version_files_is_alembics() -> None:
    """``head_revision`` reads what Alembic reads: a new migration moves both."""
    heads = ScriptDirectory.from_config(alembic_config("sqlite:///unused.db")).get_heads()
    assert [head_revision()] == heads


def test_a_start_at_head_loads_no_alembic_and_one_behind_is_migrated(store_url: str) -> None:
    """A server's start on a database at head skips Alembic (boot time, benchmarks/boot.py);
    one revision behind (or no table yet), it migrates: the fast path skips nothing it must run."""
    import subprocess
    import sys

    assert not at_head(store_url)  # a new database: no alembic_version yet
    upgrade(store_url)
    assert at_head(store_url)
    probe = ("import sys; from app.store.db import upgrade; upgrade(sys.argv[1]); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))")
    done = subprocess.run([sys.executable, "-c", probe, store_url], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "[]", done.stderr
    heads = ScriptDirectory.from_config(alembic_config(store_url)).get_heads()
    previous = ScriptDirectory.from_config(alembic_config(store_url)).get_revision(heads[0]).down_revision
    command.downgrade(alembic_config(store_url), previous)
    assert not at_head(store_url)
    upgrade(store_url)
    engine = make_engine(store_url)
    with engine.connect() as connection:
        assert [connection.execute(text("SELECT version_num FROM alembic_version")).scalar()] == heads
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    engine.dispose()
