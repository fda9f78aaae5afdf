"""`semantic sql`: read-only queries and the documented views, on a real SQLite file."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from app.errors import InvalidRequest
from app.store.db import make_engine, make_session_factory, upgrade
from app.store.models import Agent, Request
from app.store.readonly import format_table, run_readonly


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "semantic.db"
    upgrade(f"sqlite:///{path}")
    sessions = make_session_factory(make_engine(f"sqlite:///{path}"))
    now = datetime(2026, 11, 21, 12, 0)
    with sessions.begin() as session:
        session.add(Agent(id="a", origin="direct", created_at=now, last_access_at=now, status="active", metadata_json={}))
        for i, (cached, total) in enumerate([(0, 100), (90, 120)]):
            session.add(Request(id=f"r{i}", agent_id="a", protocol="anthropic", status="ok", created_at=now,
                                n_input_tokens=total, n_cached_tokens=cached, n_output_tokens=10))
        session.add(Request(id="bad", protocol="anthropic", status="rejected", created_at=now))
    return path


def test_views_answer_the_common_questions(db: Path) -> None:
    assert run_readonly(db, "SELECT agent_id, turns, input_tokens FROM agent_turns")[1] == [("a", 2, 220)]
    assert run_readonly(db, "SELECT hit_rate FROM agent_cache_hits WHERE agent_id = 'a'")[1] == [(round(90 / 220, 4),)]
    assert run_readonly(db, "SELECT day, requests, output_tokens FROM tokens_per_day")[1] == [("2026-11-21", 2, 20)]


@pytest.mark.parametrize("statement", [
    "INSERT INTO agents (id, origin, created_at, last_access_at, status, metadata_json) VALUES ('x','d','t','t','a','{}')",
    "UPDATE requests SET status = 'ok'",
    "DELETE FROM requests",
    "DROP TABLE requests",
    "CREATE TABLE t (x)",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA journal_mode = DELETE",
    "PRAGMA query_only = OFF",
])
def test_writes_and_side_doors_are_refused(db: Path, statement: str) -> None:
    with pytest.raises(InvalidRequest, match="refused or invalid SQL"):
        run_readonly(db, statement)
    assert run_readonly(db, "SELECT count(*) FROM requests")[1] == [(3,)]


def test_table_output() -> None:
    text = format_table(["a", "bb"], [(1, None), (22, "x")])
    assert text.splitlines() == ["a   bb", "--  --", "1", "22  x", "(2 rows)"]


def test_a_runaway_statement_stops_at_its_deadline(db: Path) -> None:
    forever = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    with pytest.raises(InvalidRequest, match="ran past its deadline of 0.5 s"):
        run_readonly(db, forever, deadline_s=0.5)


def test_json_table_functions_work(db: Path) -> None:
    assert run_readonly(db, "SELECT value FROM json_each('[1, 2, 3]')").rows == [(1,), (2,), (3,)]
    assert run_readonly(db, "SELECT count(*) FROM json_tree('{\"a\": {\"b\": 1}}')").rows == [(3,)]
    assert run_readonly(db, "SELECT '{\"a\": 7}' ->> 'a', json_extract('[5]', '$[0]')").rows == [(7, 5)]


@pytest.mark.parametrize("call", ["fts3_tokenizer('simple')", "randomblob(200000000)", "zeroblob(2000)",
                                  "load_extension('x')"])
def test_functions_off_the_list_are_refused(db: Path, call: str) -> None:
    with pytest.raises(InvalidRequest, match="refused or invalid SQL"):
        run_readonly(db, f"SELECT {call}")


def test_huge_values_and_long_results_are_capped(db: Path) -> None:
    with pytest.raises(InvalidRequest, match="too big"):
        run_readonly(db, "SELECT replace(printf('%.*c', 1000, 'x'), 'x', printf('%.*c', 100000, 'y'))")
    many = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 50) SELECT i FROM n"
    result = run_readonly(db, many, max_rows=20)
    assert len(result.rows) == 20 and result.truncated
    assert format_table(*result).endswith("(20 rows, more not shown: narrow the query or add LIMIT)")
    assert not run_readonly(db, many).truncated


@pytest.fixture()
def pg_db(postgres) -> str:  # type: ignore[no-untyped-def]
    import uuid

    url = postgres.create_database(f"sql_{uuid.uuid4().hex[:10]}")
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    now = datetime(2026, 11, 21, 12, 0)
    with sessions.begin() as session:
        session.add(Agent(id="a", origin="direct", created_at=now, last_access_at=now, status="active", metadata_json={}))
        session.add(Request(id="r0", agent_id="a", protocol="anthropic", status="ok", created_at=now,
                            n_input_tokens=120, n_cached_tokens=90, n_output_tokens=10))
    return url


def test_postgres_console_reads_views_and_refuses_every_write(pg_db: str) -> None:
    from app.store.readonly import run_readonly_postgres

    assert run_readonly_postgres(pg_db, "SELECT agent_id, turns, input_tokens FROM agent_turns")[1] == [("a", 1, 120)]
    assert run_readonly_postgres(pg_db, "SELECT '100%' AS x")[1] == [("100%",)]
    for statement in ("DELETE FROM requests", "UPDATE agents SET status = 'x'", "CREATE TABLE t (a int)",
                      # a second statement after COMMIT would run outside the read-only transaction
                      "COMMIT; SET default_transaction_read_only = off; COMMIT; DELETE FROM requests"):
        with pytest.raises(InvalidRequest, match="refused or invalid"):
            run_readonly_postgres(pg_db, statement)
    with pytest.raises(InvalidRequest, match="deadline"):
        run_readonly_postgres(pg_db, "SELECT pg_sleep(5)", deadline_s=0.5)
    assert run_readonly_postgres(pg_db, "SELECT count(*) FROM requests")[1] == [(1,)]
    result = run_readonly_postgres(pg_db, "SELECT generate_series(1, 50)", max_rows=10)
    assert len(result.rows) == 10 and result.truncated
