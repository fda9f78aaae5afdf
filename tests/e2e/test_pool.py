"""`semantic pool up`: real PostgreSQL, real HAProxy, two real servers and a worker on
loopback. Agents stay on their server; a kill -9 sends the next turn elsewhere with the
whole history; `pool down` stops everything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.store.db import make_engine
from conftest import ROOT, free_port

SYSTEM = "You answer hardware store questions in one short sentence. " * 20


def turn(router: str, agent: str, history: list[dict]) -> tuple[str, str]:
    """One greedy turn of ``agent``: (the server that answered, the reply)."""
    response = httpx.post(f"{router}/v1/messages", timeout=120, headers={"x-claude-code-session-id": agent}, json={
        "model": "claude-sonnet-5", "max_tokens": 8, "temperature": 0, "system": SYSTEM, "messages": history})
    assert response.status_code == 200, response.text
    return response.headers["x-semantic-server"], response.json()["content"][0]["text"]


def semantic(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SEMANTIC_HOME": str(home)})


def test_agents_stay_on_their_server_and_survive_its_kill(tmp_path: Path, smollm2_dir: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(smollm2_dir.parent, target_is_directory=True)
    port = free_port()
    env = {**os.environ, "SEMANTIC_HOME": str(home), "SEMANTIC_MODEL": smollm2_dir.name}
    env.pop("SEMANTIC_DATABASE_URL", None)
    log = (tmp_path / "pool.log").open("wb")
    pool = subprocess.Popen([sys.executable, "-m", "app", "pool", "up", "--servers", "2", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    state_path = home / "pool" / "state.json"
    state: dict = {}
    try:
        deadline = time.monotonic() + 240
        while not state_path.exists():
            assert pool.poll() is None and time.monotonic() < deadline, (tmp_path / "pool.log").read_text()
            time.sleep(0.5)
        state = json.loads(state_path.read_text())
        router = state["router"]

        histories: dict[str, list[dict]] = {f"agent-{i}": [] for i in range(4)}
        placed: dict[str, set[str]] = {agent: set() for agent in histories}
        for n in range(3):
            for agent, history in histories.items():
                history.append({"role": "user", "content": f"Question {n} from {agent}: do you sell nails?"})
                server, reply = turn(router, agent, history)
                history.append({"role": "assistant", "content": reply})
                placed[agent].add(server)
        assert all(len(servers) == 1 for servers in placed.values()), placed

        victim = "agent-0"
        (held,) = placed[victim]
        pid = next(s["pid"] for s in state["servers"] if s["id"] == held)
        os.kill(pid, signal.SIGKILL)
        histories[victim].append({"role": "user", "content": "Still there?"})
        server, reply = turn(router, victim, histories[victim])
        assert server != held
        histories[victim].append({"role": "assistant", "content": reply})

        status = semantic(home, "pool", "status", "--json")
        assert status.returncode == 1  # one server is down
        assert {s["id"]: s["healthy"] for s in json.loads(status.stdout)} == {held: False, server: True}

        engine = make_engine(state["database_url"], poolclass=NullPool)
        with engine.connect() as connection:
            stored = dict(connection.execute(text("SELECT agent_id, count(*) FROM messages GROUP BY agent_id")).all())
        engine.dispose()
        assert stored == {agent: len(history) for agent, history in histories.items()}  # every turn, both servers

        assert semantic(home, "pool", "down").returncode == 0
        assert pool.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{router}/health", timeout=2)
    finally:
        if pool.poll() is None:
            pool.send_signal(signal.SIGTERM)
            pool.wait(timeout=60)
        if state.get("postgres_dir"):
            shutil.rmtree(state["postgres_dir"], ignore_errors=True)
