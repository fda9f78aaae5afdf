"""A database locked by another writer: 503 with retry-after before generation, and a
finished turn's history retried until it is stored (issue 12, item 8).

The server runs with a 0.5 s busy timeout so a lock held by this test (a plain sqlite3
connection in ``BEGIN IMMEDIATE``, as the worker's compact or a second process would
hold it) outlasts it quickly.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query

BODY = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Name a colour."}]}


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    running = start_server(tmp_path_factory.mktemp("busy-home"), smollm2_dir,
                           {"SEMANTIC_DB_BUSY_TIMEOUT_S": "0.5"})
    yield running
    stop_server(running)


def hold_write_lock(db_path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    connection.execute("BEGIN IMMEDIATE")
    return connection


def test_a_locked_database_is_a_503_with_retry_after_and_nothing_half_written(busy_server: ServerProcess) -> None:
    headers = {"x-claude-code-session-id": "busy-refused"}
    lock = hold_write_lock(busy_server.db_path)
    try:
        refused = httpx.post(f"{busy_server.url}/v1/messages", json=BODY, headers=headers, timeout=60)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["type"] == "error" and "database is busy" in refused.json()["error"]["message"]
    assert query(busy_server.db_path, "SELECT count(*) FROM agents WHERE id = 'busy-refused'") == [(0,)]
    # The client retries once the lock is gone, as SDKs do on 503.
    retried = httpx.post(f"{busy_server.url}/v1/messages", json=BODY, headers=headers, timeout=120)
    assert retried.status_code == 200, retried.text
    assert query(busy_server.db_path, "SELECT count(*) FROM messages WHERE agent_id = 'busy-refused'") == [(2,)]


def release_once_a_write_waited(lock: sqlite3.Connection, server: ServerProcess) -> threading.Thread:
    """Hold ``lock`` until the server logs that a write found the database locked (whenever
    the turn gets there, however loaded the machine), then let it go."""
    def wait_then_release() -> None:
        deadline = time.monotonic() + 60
        while "database locked (attempt 1 of 4)" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        lock.execute("ROLLBACK")
        lock.close()

    thread = threading.Thread(target=wait_then_release)
    thread.start()
    return thread


def test_a_finished_turn_waits_out_a_lock_and_keeps_its_history(busy_server: ServerProcess) -> None:
    """The lock is taken once the request is accepted (its message_start arrived) and held
    until a write of the turn has waited a whole busy timeout for it: the turn's cache rows
    and its history retry until they land."""
    headers = {"x-claude-code-session-id": "busy-kept"}
    events: list[str] = []
    release: threading.Thread | None = None
    with httpx.stream("POST", f"{busy_server.url}/v1/messages", json={**BODY, "stream": True},
                      headers=headers, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event["type"])
            if event["type"] == "message_start":
                release = release_once_a_write_waited(hold_write_lock(busy_server.db_path), busy_server)
    assert release is not None
    release.join()
    assert "database locked (attempt 1 of 4)" in busy_server.log()
    assert events[-1] == "message_stop" and "error" not in events
    rows = query(busy_server.db_path, "SELECT role FROM messages WHERE agent_id = 'busy-kept' ORDER BY position")
    assert rows == [("user",), ("assistant",)]
    assert query(busy_server.db_path, "SELECT status FROM requests WHERE agent_id = 'busy-kept'") == [("ok",)]
    busy_server_flushed = time.monotonic() + 30  # the cache row is the persister's, after the stream
    while query(busy_server.db_path, "SELECT count(*) FROM caches WHERE agent_id = 'busy-kept'") != [(1,)]:
        assert time.monotonic() < busy_server_flushed
        time.sleep(0.1)
    assert "persisting a cache failed" not in busy_server.log()
