"""A real server whose store is PostgreSQL (pool mode's shared store): history, the cache
index, a SIGKILL and a restart, the worker's queue in the same database, and an outage of
the database itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import pytest
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.pool.postgres import LocalPostgres
from app.store.db import make_engine
from conftest import ROOT
from support.servers import ServerProcess, free_port, start_server, stop_server
from support.store_check import store_problems

SYSTEM = "You are a terse assistant for a hardware store. " + "Always answer in one short sentence. " * 50


def pg(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql), params)]
    finally:
        engine.dispose()


def ask(server: ServerProcess, history: list[dict], session: str) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)
    return client.messages.create(model="claude-sonnet-5", max_tokens=16, system=SYSTEM, messages=history,
                                  extra_body={"temperature": 0}, extra_headers={"X-Claude-Code-Session-Id": session})


def wait_persisted(url: str, agent: str, n_tokens: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (found,), = pg(url, "SELECT max(n_tokens) FROM caches WHERE agent_id = :a", a=agent)
        if found is not None and found >= n_tokens:
            return
        time.sleep(0.1)
    raise AssertionError(f"the cache of {agent} did not reach the store")


def test_history_and_caches_live_in_postgres_and_survive_a_kill(tmp_path: Path, smollm2_dir: Path,
                                                                 postgres) -> None:  # type: ignore[no-untyped-def]
    url = postgres.create_database(f"e2e_{uuid.uuid4().hex[:10]}")
    home = tmp_path / "home"
    env = {"SEMANTIC_DATABASE_URL": url.replace("postgresql+psycopg://", "postgresql://"), "SEMANTIC_SERVER_ID": "pg-a"}
    server = start_server(home, smollm2_dir, env)
    history = [{"role": "user", "content": "Do you sell hammers?"}]
    try:
        first = ask(server, history, "s")
        raw = anthropic.Anthropic(base_url=server.url, api_key="k").messages.with_raw_response.count_tokens(
            model="m", messages=history)
        assert raw.headers["x-semantic-server"] == "pg-a"
        history += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And nails?"}]
        second = ask(server, history, "s")
        assert second.usage.cache_read_input_tokens > 0
        n_cached = second.usage.input_tokens + second.usage.cache_read_input_tokens + second.usage.output_tokens
        wait_persisted(url, "s", n_cached - 1)
    except BaseException:
        stop_server(server)
        raise
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    assert not (home / "semantic.db").exists()  # nothing went to a SQLite file

    server = start_server(home, smollm2_dir, env)
    try:
        history += [{"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "Bye."}]
        third = ask(server, history, "s")
        assert third.usage.cache_read_input_tokens >= n_cached - 1  # read back through the index in PostgreSQL
        rows = pg(url, "SELECT reuse_reason FROM requests WHERE agent_id = 's' ORDER BY created_at")
        assert [outcome for outcome, in rows][1:] == ["extend", "extend"]
        assert pg(url, "SELECT role FROM messages WHERE agent_id = 's' ORDER BY conversation_id, position") == [
            ("user",), ("assistant",), ("user",), ("assistant",), ("user",), ("assistant",)]
    finally:
        stop_server(server)
    assert store_problems(home, url) == []


def test_the_worker_queue_lives_in_postgres(tmp_path: Path, smollm2_dir: Path,
                                            postgres) -> None:  # type: ignore[no-untyped-def]
    """`semantic serve` with its worker child: a job enqueued by another process (any server
    of a pool) is run by that worker through PostgresHuey, and its run is recorded."""
    url = postgres.create_database(f"e2e_{uuid.uuid4().hex[:10]}")
    home = tmp_path / "home"
    env = {"SEMANTIC_DATABASE_URL": url, "SEMANTIC_WORKER": "1"}
    server = start_server(home, smollm2_dir, env)
    try:
        enqueue = "from worker.tasks import expire; expire()"  # periodic tasks keep no result: read job_runs
        done = subprocess.run([sys.executable, "-c", enqueue], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SEMANTIC_HOME": str(home), **env})
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 60
        while ("expire", "ok") not in set(pg(url, "SELECT name, status FROM job_runs")) and time.monotonic() < deadline:
            time.sleep(0.2)
        runs = set(pg(url, "SELECT name, status FROM job_runs"))
        assert ("expire", "ok") in runs
        assert {status for _, status in runs} == {"ok"}  # the schedule may add its own (evict, expire) as it crosses a minute
        assert not (home / "huey.db").exists()
        assert pg(url, "SELECT count(*) FROM huey_task") == [(0,)]  # taken off the queue
    finally:
        stop_server(server)


def test_a_database_outage_is_a_503_with_retry_after_and_service_resumes(tmp_path: Path, smollm2_dir: Path) -> None:
    """A cluster of the test's own, stopped and started under a running server."""
    root = Path(tempfile.mkdtemp(prefix="semantic-pg-outage-"))
    root.chmod(0o755)
    cluster = LocalPostgres(root / "pg", free_port())
    cluster.start(durable=False)
    url = cluster.create_database("outage")
    server = start_server(tmp_path / "home", smollm2_dir, {"SEMANTIC_DATABASE_URL": url})
    client = anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)
    body = {"model": "claude-sonnet-5", "max_tokens": 4, "system": SYSTEM, "extra_body": {"temperature": 0},
            "extra_headers": {"X-Claude-Code-Session-Id": "o"}}
    try:
        client.messages.create(messages=[{"role": "user", "content": "Hi"}], **body)
        cluster.stop("immediate")
        with pytest.raises(anthropic.APIStatusError) as refused:
            client.messages.create(messages=[{"role": "user", "content": "Hi again"}], **body)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "5"
        assert refused.value.body["error"]["message"] == "the database is unavailable; retry shortly"
        cluster.start(durable=False)
        answer = client.messages.create(messages=[{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello"},
                                                  {"role": "user", "content": "Back?"}], **body)
        assert answer.content
        assert len(pg(url, "SELECT id FROM messages WHERE agent_id = 'o'")) >= 4
    finally:
        stop_server(server)
        cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
