"""`semantic serve` as the README's first command runs it: port bound first, /health says
"loading" until the model is ready, the worker runs as its child, both stop together."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import ROOT
from support.servers import free_port, start_server, stop_server


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def semantic_env(home: Path, port: int) -> dict[str, str]:
    env = {**os.environ, "SEMANTIC_HOME": str(home), "SEMANTIC_PORT": str(port)}
    env.pop("SEMANTIC_CONFIG", None)
    env.pop("SEMANTIC_WORKER", None)
    return env


def test_loading_then_ready_with_a_worker_child_and_status(tmp_path: Path, smollm2_dir: Path) -> None:
    port = free_port()
    env = semantic_env(tmp_path, port)
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(smollm2_dir)], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: list[str] = []
    while_loading = None  # a chat completion sent while the model loads
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "ok" not in seen:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                seen.append(response.json()["status"])
                assert response.status_code == (200 if seen[-1] == "ok" else 503)
                if seen[-1] == "loading" and (while_loading is None or while_loading.status_code != 503):
                    while_loading = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                        "model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert seen and seen[0] == "loading" and seen[-1] == "ok", seen
        # Not a failure: a 503 the SDKs retry after the time it names, and no error in the log.
        assert while_loading is not None and while_loading.status_code == 503, while_loading
        assert while_loading.headers["retry-after"] == "1"
        assert while_loading.json()["error"]["message"] == "the model is still loading"
        workers = [pid for pid in children(server.pid) if "app worker" in cmdline(pid)]
        assert len(workers) == 1, [cmdline(p) for p in children(server.pid)]
        # Below the server's priority: its start and its jobs yield the cores to loading and serving.
        assert os.getpriority(os.PRIO_PROCESS, workers[0]) == min(19, os.getpriority(os.PRIO_PROCESS, server.pid) + 10)
        status = subprocess.run([sys.executable, "-m", "app", "status"], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert f"http://127.0.0.1:{port}: ok" in status.stdout and "smollm2" in status.stdout
        for heading in ("queue", "pool", "caches", "disk", "jobs"):
            assert heading in status.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
               for pid in workers)
    assert "worker stopped" in (tmp_path / "serve.log").read_text()
    assert "GET /health 503" not in (tmp_path / "serve.log").read_text()  # a probe while loading: DEBUG
    assert "POST /v1/chat/completions 503" in (tmp_path / "serve.log").read_text()
    assert " ERROR " not in (tmp_path / "serve.log").read_text()


def test_flags_reach_the_server_and_its_worker(tmp_path: Path, smollm2_dir: Path) -> None:
    """The variables name one home and port, the flags others: the server and the worker
    child it starts both use the flags' (the worker reads its settings from its environment)."""
    env_home, flag_home, port = tmp_path / "env-home", tmp_path / "flag-home", free_port()
    env = semantic_env(env_home, 1)
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", str(smollm2_dir), "--home",
                                   str(flag_home), "--port", str(port), "--server-id", "from-a-flag", "--worker"],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        health = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (health and (flag_home / "huey.db").exists()):
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert health is not None and health["server_id"] == "from-a-flag", (tmp_path / "serve.log").read_text()
        assert (flag_home / "semantic.db").exists() and (flag_home / "huey.db").exists()  # the worker's queue
        assert not env_home.exists()
        # `semantic status` finds the server of its home on the port the flag gave it, not the configured one.
        status = subprocess.run([sys.executable, "-m", "app", "status"], cwd=ROOT, capture_output=True, text=True,
                                env=semantic_env(flag_home, 1), timeout=60)
        assert f"http://127.0.0.1:{port}: " in status.stdout and "not running" not in status.stdout, status.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0


def test_a_busy_port_is_a_one_line_error(tmp_path: Path, smollm2_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--no-worker", "--model", str(smollm2_dir)],
                              cwd=ROOT, env=semantic_env(tmp_path, port), capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"semantic: error: cannot listen on 127.0.0.1:{port}: Address already in use"], done.stderr


def test_status_without_a_server(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "app", "status"], cwd=ROOT, env=semantic_env(tmp_path, free_port()),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not running" in done.stdout
    url = f"http://127.0.0.1:{free_port()}"
    as_json = subprocess.run([sys.executable, "-m", "app", "status", "--json", "--url", url], cwd=ROOT,
                             env=semantic_env(tmp_path, free_port()), capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["health"] is None
    assert json.loads(as_json.stdout)["url"] == url


def test_a_json_log_has_one_object_a_line_and_no_alembic(tmp_path: Path, smollm2_dir: Path) -> None:
    server = start_server(tmp_path, smollm2_dir, {"SEMANTIC_LOG_FORMAT": "json"})
    try:
        missing = httpx.get(f"{server.url}/v1/nowhere", headers={"user-agent": "json-test"})
    finally:
        stop_server(server)
    records = [json.loads(line) for line in server.log().splitlines()]
    assert not [r for r in records if r["logger"].startswith("alembic")]
    [access] = [r for r in records if r.get("request_id") == missing.headers["request-id"]]
    assert {k: access[k] for k in ("level", "method", "path", "status", "agent", "client")} == {
        "level": "INFO", "method": "GET", "path": "/v1/nowhere", "status": 404, "agent": None, "client": "json-test"}
    assert any("listening on" in r["message"] for r in records)


def test_one_server_per_home_and_readers_beside_it(tmp_path: Path, smollm2_dir: Path) -> None:
    """A second `semantic serve` on the same home refuses at once, naming the first; the
    first one's worker and the commands that only read keep working."""
    first = start_server(tmp_path, smollm2_dir, {"SEMANTIC_WORKER": "1"})
    env = semantic_env(tmp_path, free_port())
    try:
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "app", "serve", "--no-worker", "--model", str(smollm2_dir)],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert time.monotonic() - started < 30 and "loaded model" not in second.stderr
        port = first.url.rsplit(":", 1)[1]
        assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == (
            f"semantic: error: {tmp_path} is already served by another semantic serve (pid {first.process.pid}, "
            f"port {port}); stop it first, or give this one its own SEMANTIC_HOME"), second.stderr
        for args in (("status", "--url", first.url), ("sql", "SELECT count(*) FROM agents"), ("config",),
                     ("models", "list")):
            done = subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, (args, done.stderr)
        [worker] = [pid for pid in children(first.process.pid) if "app worker" in cmdline(pid)]
        assert "worker starting" in first.log()
        assert httpx.get(f"{first.url}/health").json()["status"] == "ok"
    finally:
        stop_server(first)
    assert not (tmp_path / "serve.json").exists()
    again = start_server(tmp_path, smollm2_dir)  # the lock went with the first server
    stop_server(again)
