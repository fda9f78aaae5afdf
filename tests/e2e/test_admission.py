"""A burst larger than the engine takes: only 2xx and 429 (with retry-after), every accepted
request completes with its history stored, and /health answers throughout."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query

BURST = 14


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    running = start_server(tmp_path_factory.mktemp("admission"), smollm2_dir,
                           {"SEMANTIC_MAX_BATCH": "2", "SEMANTIC_MAX_QUEUE": "3"})
    yield running
    stop_server(running)


def ask(server: ServerProcess, i: int) -> httpx.Response:
    body = {"model": "m", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {i}: write a sentence about the sea."}]}
    return httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-session-id": f"burst-{i}"}, timeout=300)


def test_a_burst_gets_answers_or_429s_and_health_answers_meanwhile(small_server: ServerProcess) -> None:
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{small_server.url}/health", timeout=10).status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.2)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            responses = list(pool.map(lambda i: ask(small_server, i), range(BURST)))
    finally:
        done.set()
        prober.join()
    statuses = [r.status_code for r in responses]
    # At least the first one (taken by the idle engine) and a full queue of 3 are accepted.
    assert set(statuses) <= {200, 429} and 429 in statuses and statuses.count(200) >= 4
    for i, response in enumerate(responses):
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
            assert query(small_server.db_path, "SELECT count(*) FROM agents WHERE id = ?", f"burst-{i}") == [(0,)]
        else:  # accepted: completed, and its history stored
            assert response.json()["content"][0]["text"]
            rows = query(small_server.db_path, "SELECT role FROM messages WHERE agent_id = ? ORDER BY position",
                         f"burst-{i}")
            assert rows == [("user",), ("assistant",)]
    assert len(health) >= 3 and max(health) < 5  # /health was never stuck behind the burst
