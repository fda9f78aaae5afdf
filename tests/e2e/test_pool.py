"""`semantic pool up`: real PostgreSQL, a real S3 server (SeaweedFS), real HAProxy, two
real servers and a worker on loopback. Agents stay on their server; a kill -9 sends the
next turn elsewhere, warm from the shared tier, with the whole history; `pool down` stops
everything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.pool.seaweed import LocalS3
from app.store.db import make_engine
from conftest import ROOT
from support.servers import free_ports
from support.pool_hosts import messages_per_agent

SYSTEM = "You answer hardware store questions in one short sentence. " * 20


def turn(router: str, agent: str, history: list[dict]) -> tuple[str, str, dict]:
    """One greedy turn of ``agent``: (the server that answered, the reply, its usage)."""
    response = httpx.post(f"{router}/v1/messages", timeout=120, headers={"x-claude-code-session-id": agent}, json={
        "model": "claude-sonnet-5", "max_tokens": 8, "temperature": 0, "system": SYSTEM, "messages": history})
    assert response.status_code == 200, response.text
    body = response.json()
    return response.headers["x-semantic-server"], body["content"][0]["text"], body["usage"]


def wait_uploaded(state: dict, agent: str, n_tokens: int, timeout_s: float = 60) -> None:
    """Until the agent's newest cache record (at least ``n_tokens``) is in the shared tier."""
    from app.cache.shared_tier import S3Tier

    tier = S3Tier(state["block_store"])
    engine = make_engine(state["database_url"], poolclass=NullPool)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            with engine.connect() as connection:
                row = connection.execute(text("SELECT record_path, n_tokens FROM caches WHERE agent_id = :a "
                                              "ORDER BY updated_at DESC LIMIT 1"), {"a": agent}).first()
            if row is not None and row[1] >= n_tokens:
                key = Path(row[0]).relative_to(Path(row[0]).parents[2]).as_posix()  # <fp16>/conversations/<name>
                if tier.fetch(key, Path(tempfile.mkdtemp()) / "record"):
                    return
            time.sleep(0.2)
    finally:
        engine.dispose()
    raise AssertionError(f"{agent}'s cache did not reach the shared tier")


def semantic(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SEMANTIC_HOME": str(home)})


@contextmanager
def running_pool(tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch,
                 n_servers: int, config: str = "") -> Iterator[tuple[Path, dict, subprocess.Popen[bytes]]]:
    """`semantic pool up --servers N` in the foreground, its home's config.toml ``config``:
    (its home, its state, the process)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(smollm2_dir.parent, target_is_directory=True)
    if config:
        (home / "config.toml").write_text(config)
    port = free_ports(n_servers + 2 + LocalS3.N_PORTS)  # the router, servers, PostgreSQL, S3
    env = {**os.environ, "SEMANTIC_HOME": str(home), "SEMANTIC_MODEL": smollm2_dir.name}
    env.pop("SEMANTIC_DATABASE_URL", None)
    log = (tmp_path / "pool.log").open("wb")
    pool = subprocess.Popen([sys.executable, "-m", "app", "pool", "up", "--servers", str(n_servers),
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    state_path = home / "pool" / "state.json"
    state: dict = {}
    try:
        deadline = time.monotonic() + 240
        while not state_path.exists():
            assert pool.poll() is None and time.monotonic() < deadline, (tmp_path / "pool.log").read_text()
            time.sleep(0.5)
        state = json.loads(state_path.read_text())
        for name, value in state["server_env"].items():  # to read the pool's own S3 from here
            if name.startswith("AWS_"):
                monkeypatch.setenv(name, value)
        yield home, state, pool
    finally:
        if pool.poll() is None:
            pool.send_signal(signal.SIGTERM)
            pool.wait(timeout=60)
        if state.get("postgres_dir"):
            shutil.rmtree(state["postgres_dir"], ignore_errors=True)


def stored_messages(state: dict) -> dict[str, int]:
    """Messages per agent in the pool's database."""
    return messages_per_agent(state["database_url"])


def prompt_tokens(usage: dict) -> int:
    return sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


def test_agents_stay_on_their_server_and_survive_its_kill(tmp_path: Path, smollm2_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with running_pool(tmp_path, smollm2_dir, monkeypatch, 2) as (home, state, pool):
        router = state["router"]
        histories: dict[str, list[dict]] = {f"agent-{i}": [] for i in range(4)}
        placed: dict[str, set[str]] = {agent: set() for agent in histories}
        prompts: dict[str, int] = {}
        for n in range(3):
            for agent, history in histories.items():
                history.append({"role": "user", "content": f"Question {n} from {agent}: do you sell nails?"})
                server, reply, usage = turn(router, agent, history)
                history.append({"role": "assistant", "content": reply})
                placed[agent].add(server)
                prompts[agent] = prompt_tokens(usage)
        assert all(len(servers) == 1 for servers in placed.values()), placed

        # Responses API agents named only by previous_response_id (no session header, no
        # body key) stay where their conversation began (before: each turn went to the
        # least busy server, which took the agent's ownership over).
        for n in range(3):
            previous, servers = None, set()
            for question in ("Do you sell glue?", "And tape?", "Which is stronger?"):
                response = httpx.post(f"{router}/v1/responses", timeout=120, json={
                    "model": "gpt-5", "max_output_tokens": 4, "temperature": 0, "instructions": SYSTEM,
                    "input": f"{question} (customer {n})", **({"previous_response_id": previous} if previous else {})})
                assert response.status_code == 200, response.text
                previous = response.json()["id"]
                assert response.headers["x-semantic-reply-id"] == previous
                servers.add(response.headers["x-semantic-server"])
            assert len(servers) == 1, servers

        victim = "agent-0"
        (held,) = placed[victim]
        cached_before = prompts[victim] - 1  # the whole last prompt but the token recomputed for logits
        wait_uploaded(state, victim, cached_before)
        pid = next(s["pid"] for s in state["servers"] if s["id"] == held)
        os.kill(pid, signal.SIGKILL)
        histories[victim].append({"role": "user", "content": "Still there?"})
        server, reply, usage = turn(router, victim, histories[victim])
        assert server != held
        assert usage["cache_read_input_tokens"] >= 0.9 * prompts[victim]  # restored from the shared tier
        histories[victim].append({"role": "assistant", "content": reply})

        status = semantic(home, "pool", "status", "--json")
        assert status.returncode == 1  # one server is down
        assert {s["id"]: s["healthy"] for s in json.loads(status.stdout)} == {held: False, server: True}
        # Every turn, on both servers (and the Responses agents' three turns each).
        stored = stored_messages(state)
        assert {agent: stored[agent] for agent in histories} == {agent: len(history) for agent, history in histories.items()}
        assert sorted(n for agent, n in stored.items() if agent not in histories) == [6, 6, 6]

        assert semantic(home, "pool", "down").returncode == 0
        assert pool.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{router}/health", timeout=2)


def test_a_joining_server_moves_no_agent_and_a_drained_one_hands_its_agents_over(
        tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_pool(tmp_path, smollm2_dir, monkeypatch, 1) as (home, state, _):
        router = state["router"]
        histories: dict[str, list[dict]] = {f"old-{i}": [] for i in range(3)}
        prompts: dict[str, int] = {}

        def step(agent: str, text: str) -> tuple[str, dict]:
            history = histories.setdefault(agent, [])
            history.append({"role": "user", "content": f"{text} ({agent})"})
            server, reply, usage = turn(router, agent, history)
            history.append({"role": "assistant", "content": reply})
            prompts[agent] = prompt_tokens(usage)
            return server, usage

        assert {step(agent, "Do you sell rope?")[0] for agent in list(histories)} == {"s1"}
        joined = semantic(home, "pool", "join")
        assert joined.returncode == 0, joined.stderr
        assert "server s2 joined" in joined.stdout
        status = json.loads(semantic(home, "pool", "status", "--json").stdout)
        assert {s["id"]: s["healthy"] for s in status} == {"s1": True, "s2": True}

        # Placed agents stay with their cache; new ones are spread over both servers.
        for agent in [a for a in histories if a.startswith("old-")]:
            before = prompts[agent]
            server, usage = step(agent, "And chain?")
            assert server == "s1" and usage["cache_read_input_tokens"] >= before - 1
        assert "s2" in {step(f"new-{i}", "Do you sell paint?")[0] for i in range(4)}

        # Drain s1: no new work, its caches flushed to the shared tier, its agents released;
        # their next turns run on s2, warm from the tier, and no turn of history is lost.
        drained = semantic(home, "pool", "drain", "s1")
        assert drained.returncode == 0, drained.stderr
        assert [s["id"] for s in json.loads(semantic(home, "pool", "status", "--json").stdout)] == ["s2"]
        engine = make_engine(state["database_url"], poolclass=NullPool)
        with engine.connect() as connection:
            owners = set(connection.execute(text("SELECT DISTINCT server_id FROM owners")).scalars())
        engine.dispose()
        assert "s1" not in owners
        for agent in [a for a in histories if a.startswith("old-")]:
            before = prompts[agent]
            server, usage = step(agent, "Thanks.")
            assert server == "s2" and usage["cache_read_input_tokens"] >= 0.9 * before
        assert stored_messages(state) == {agent: len(history) for agent, history in histories.items()}
        refused = semantic(home, "pool", "drain", "s1")
        assert refused.returncode == 2 and "no server 's1'" in refused.stderr


def test_a_keyed_homes_pool_asks_for_the_key_through_its_router(tmp_path: Path, smollm2_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The home's config.toml reaches the servers and the worker (before: dropped, so the
    router served every agent without a key, and TTLs differed between worker and servers)."""
    config = 'api_key = "pool-key"\ncache_ttl_seconds = 600\n'
    with running_pool(tmp_path, smollm2_dir, monkeypatch, 1, config) as (home, state, _):
        router = state["router"]
        assert httpx.get(f"{router}/v1/agents", timeout=30).status_code == 401
        assert httpx.get(f"{router}/v1/agents", timeout=30, headers={"x-api-key": "pool-key"}).status_code == 200
        assert state["server_env"]["SEMANTIC_CACHE_TTL_SECONDS"] == "600"
        assert (home / "pool" / "state.json").stat().st_mode & 0o777 == 0o600  # it holds the key


def test_router_config_for_servers_on_other_machines_is_valid_haproxy(tmp_path: Path) -> None:
    done = semantic(tmp_path, "pool", "router-config", "--server", "s1=10.0.0.5:8000", "--server", "s2=10.0.0.6:8000",
                    "--bind", "0.0.0.0", "--port", "8080", "--admin-socket", str(tmp_path / "admin.sock"))
    assert done.returncode == 0, done.stderr
    config = tmp_path / "haproxy.cfg"
    config.write_text(done.stdout)
    assert "bind 0.0.0.0:8080" in done.stdout and "server s2 10.0.0.6:8000" in done.stdout
    checked = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    refused = semantic(tmp_path, "pool", "router-config", "--server", "s1")
    assert refused.returncode == 2 and "ID=HOST:PORT" in refused.stderr


def test_pool_up_refuses_a_taken_port_naming_it_and_its_use(tmp_path: Path) -> None:
    """Every port the pool will listen on is checked before anything starts (before: a taken
    PostgreSQL port surfaced as pg_ctl's "PID file ... does not exist")."""
    import socket

    port = free_ports(3 + LocalS3.N_PORTS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))  # the PostgreSQL port of a one-server pool
        taken.listen()
        env = {**os.environ, "SEMANTIC_HOME": str(tmp_path)}
        for own in ("SEMANTIC_DATABASE_URL", "SEMANTIC_BLOCK_STORE"):  # the pool's own stores, their ports too
            env.pop(own, None)
        done = subprocess.run([sys.executable, "-m", "app", "pool", "up", "--servers", "1", "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert f"port {port + 2} (the pool's PostgreSQL) is in use" in done.stderr
    assert not (tmp_path / "pool" / "state.json").exists()
