"""A pool over several hosts, each a Linux network namespace with its own address on one
bridge (tests/support/netns.py): PostgreSQL, the S3 tier (SeaweedFS) and the worker on
``store``, HAProxy on ``router`` (``semantic pool router-config``, its runtime API over
TCP), a server on ``h1`` and ``h2`` (``semantic serve --host 0.0.0.0``), every part
reaching the others by address, never loopback: what docs/pool.md's "Several machines"
runs. A server partitioned from the database answers 503 with retry-after; a whole host
killed (every process of its namespace, its link cut) and its agents continue warm on the
other from the tier, ownership moving forward; a third host joins the running router with
``semantic pool join --router`` and serves new agents, then drains with
``semantic pool drain --router``."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.pool.haproxy import RuntimeAPI
from app.pool.postgres import LocalPostgres
from app.pool.seaweed import LocalS3
from app.store.db import make_engine
from conftest import ROOT
from support.netns import Hosts, unavailable
from test_pool import SYSTEM, prompt_tokens, stored_messages, wait_uploaded

PORT = 8000  # every server on its own host's port 8000, as on real machines
ADMIN_PORT = 9999
KEY = "pool-hosts-key"  # servers bound to 0.0.0.0 ask for one


def ask(url: str, agent: str, history: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", timeout=120, headers={"x-claude-code-session-id": agent, "x-api-key": KEY},
                      json={"model": "claude-sonnet-5", "max_tokens": 8, "temperature": 0, "system": SYSTEM,
                            "messages": history})


def turn(url: str, agent: str, history: list[dict]) -> tuple[str, str, dict]:
    """One greedy turn of ``agent``: (the server that answered, the reply, its usage)."""
    response = ask(url, agent, history)
    assert response.status_code == 200, response.text
    body = response.json()
    return response.headers["x-semantic-server"], body["content"][0]["text"], body["usage"]


def owners(database_url: str) -> dict[str, tuple[str, int]]:
    engine = make_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return {agent: (server, epoch) for agent, server, epoch in
                    connection.execute(text("SELECT agent_id, server_id, epoch FROM owners"))}
    finally:
        engine.dispose()


def wait_healthy(url: str, process_of: str, log_path: Path, process: subprocess.Popen[bytes],
                 timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"{process_of} at {url} was not ready:\n{log_path.read_text(errors='replace')[-3000:]}")


def test_a_pool_over_hosts_survives_a_host_and_takes_one_joining(tmp_path: Path, smollm2_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    for tool in ("haproxy", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    pg_root = Path(tempfile.mkdtemp(prefix="semantic-pg-hosts-"))
    pg_root.chmod(0o755)  # the postgres user enters it
    logs = tmp_path / "logs"
    logs.mkdir()
    with Hosts(["store", "router", "h1", "h2", "h3"]) as hosts:
        address = hosts.addresses
        base = {k: v for k, v in os.environ.items() if not k.startswith("SEMANTIC_")}

        # The store host: PostgreSQL and the S3 tier on its address, and the pool's worker.
        cluster = LocalPostgres(pg_root / "pg", 5432, secrets.token_urlsafe(16), host=address["store"])
        made = hosts.run("store", [sys.executable, "-c", "import sys; from pathlib import Path; "
                                   "from app.pool.postgres import LocalPostgres as P; "
                                   "c = P(Path(sys.argv[1]), 5432, sys.argv[2], host=sys.argv[3]); "
                                   "c.start(durable=False); c.create_database('pool')",
                                   str(cluster.root), cluster.password, cluster.host], base, cwd=ROOT)
        assert made.returncode == 0, made.stderr
        try:
            database_url = cluster.url("pool")
            s3 = LocalS3(tmp_path / "s3", 8333, ip=address["store"])
            hosts.popen("store", s3.command(), {**base, **s3.credentials}, logs / "s3.log")
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(s3.endpoint, timeout=1).close()
                    break
                except urllib.error.HTTPError:  # 403 without credentials: up
                    break
                except OSError:
                    assert time.monotonic() < deadline, (logs / "s3.log").read_text()
                    time.sleep(0.2)
            for name, value in s3.credentials.items():  # to read the tier from here
                monkeypatch.setenv(name, value)
            pool_env = {**base, "SEMANTIC_DATABASE_URL": database_url, "SEMANTIC_BLOCK_STORE": s3.block_store,
                        **s3.credentials, "SEMANTIC_MODEL": smollm2_dir.name, "SEMANTIC_API_KEY": KEY}
            state = {"database_url": database_url, "block_store": s3.block_store}

            def host_env(name: str) -> dict[str, str]:
                home = tmp_path / name
                home.mkdir(exist_ok=True)
                if not (home / "models").exists():
                    (home / "models").symlink_to(smollm2_dir.parent, target_is_directory=True)
                return {**pool_env, "SEMANTIC_HOME": str(home), "SEMANTIC_SERVER_ID": name}

            def serve(name: str) -> subprocess.Popen[bytes]:
                return hosts.popen(name, [sys.executable, "-m", "app", "serve", "--host", "0.0.0.0", "--port", str(PORT),
                                   "--no-worker"], host_env(name), logs / f"{name}.log", cwd=ROOT)

            first = serve("h1")  # the first migrates the database; the second starts beside the worker
            wait_healthy(f"http://{address['h1']}:{PORT}", "h1", logs / "h1.log", first)
            second = serve("h2")
            hosts.popen("store", [sys.executable, "-m", "app", "worker"], host_env("store"), logs / "worker.log",
                        cwd=ROOT)
            wait_healthy(f"http://{address['h2']}:{PORT}", "h2", logs / "h2.log", second)

            # The router host: HAProxy from `pool router-config`, its runtime API on its own address.
            admin = f"{address['router']}:{ADMIN_PORT}"
            config = hosts.run("router", [sys.executable, "-m", "app", "pool", "router-config",
                                          "--server", f"h1={address['h1']}:{PORT}",
                                          "--server", f"h2={address['h2']}:{PORT}", "--bind", address["router"],
                                          "--port", str(PORT), "--admin-socket", admin], base, cwd=ROOT)
            assert config.returncode == 0, config.stderr
            assert f"stats socket ipv4@{admin} level admin" in config.stdout
            (tmp_path / "haproxy.cfg").write_text(config.stdout)
            haproxy = hosts.popen("router", ["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")], base,
                                  logs / "haproxy.log")
            router = f"http://{address['router']}:{PORT}"
            wait_healthy(router, "the router", logs / "haproxy.log", haproxy, timeout_s=30)

            # Agents stay on their server.
            histories: dict[str, list[dict]] = {f"agent-{i}": [] for i in range(4)}
            placed: dict[str, set[str]] = {agent: set() for agent in histories}
            prompts: dict[str, int] = {}

            def step(agent: str, content: str) -> tuple[str, dict]:
                history = histories.setdefault(agent, [])
                history.append({"role": "user", "content": f"{content} ({agent})"})
                server, reply, usage = turn(router, agent, history)
                history.append({"role": "assistant", "content": reply})
                placed.setdefault(agent, set()).add(server)
                prompts[agent] = prompt_tokens(usage)
                return server, usage

            for n in range(2):
                for agent in list(histories):
                    step(agent, f"Question {n}: do you sell nails?")
            assert all(len(servers) == 1 for servers in placed.values()), placed
            assert {s for servers in placed.values() for s in servers} == {"h1", "h2"}, placed
            before = owners(database_url)
            assert {agent: server for agent, (server, _) in before.items()} == \
                {agent: next(iter(servers)) for agent, servers in placed.items()}

            victim = "h1"
            moved = [agent for agent, servers in placed.items() if servers == {victim}]
            for agent in moved:
                wait_uploaded(state, agent, prompts[agent] - 1)

            # Partitioned from the database (and the tier), h1 serves nothing: 503, retry-after.
            hosts.unreachable(victim, address["store"])
            agent = moved[0]
            refused = ask(f"http://{address[victim]}:{PORT}", agent,
                          [*histories[agent], {"role": "user", "content": "Hello?"}])
            assert refused.status_code == 503, refused.text
            assert refused.elapsed.total_seconds() < 30  # its open connections fail too (tcp_user_timeout)
            assert refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["message"] == "the database is unavailable; retry shortly"

            # The whole host fails: every process of it killed, its link cut. Its agents go on on
            # h2, warm from the tier, and h2 owns them at a later epoch.
            hosts.kill_all(victim)
            hosts.link(victim, up=False)
            for agent in moved:
                previous = prompts[agent]
                server, usage = step(agent, "Still there?")
                assert server == "h2"
                assert usage["cache_read_input_tokens"] >= 0.9 * previous, (agent, usage, previous)
            after = owners(database_url)
            for agent, (server, epoch) in after.items():
                assert epoch >= before[agent][1], (agent, before[agent], after[agent])
                if agent in moved:
                    assert server == "h2" and epoch > before[agent][1], (agent, before[agent], after[agent])
                else:
                    assert after[agent] == before[agent]

            # A third host joins the running router from its own host, and takes new agents.
            joined = hosts.run("h3", [sys.executable, "-m", "app", "pool", "join", "--router", admin,
                                      "--address", f"{address['h3']}:{PORT}", "--id", "h3"],
                               host_env("h3"), cwd=ROOT)
            assert joined.returncode == 0, joined.stdout + joined.stderr
            assert "server h3 joined" in joined.stdout
            state_of = RuntimeAPI(admin).command("show servers state servers")
            assert f" h3 {address['h3']} " in state_of, state_of
            newcomers = []
            for i in range(4):
                newcomers.append(f"new-{i}")
                if step(f"new-{i}", "Do you sell paint?")[0] == "h3":
                    break
            assert placed[newcomers[-1]] == {"h3"}, {a: placed[a] for a in newcomers}

            # It drains from its own host: no new work, stopped (flushed, its agents released);
            # its agent's next turn runs on h2, warm from the tier.
            newcomer = newcomers[-1]
            drained = hosts.run("h3", [sys.executable, "-m", "app", "pool", "drain", "h3", "--router", admin],
                                host_env("h3"), cwd=ROOT)
            assert drained.returncode == 0, drained.stdout + drained.stderr
            assert "server h3 drained" in drained.stdout
            assert hosts.pids("h3") == []
            previous = prompts[newcomer]
            server, usage = step(newcomer, "Thanks.")
            assert server == "h2" and usage["cache_read_input_tokens"] >= 0.9 * previous, (server, usage, previous)
            final = owners(database_url)
            assert all(final[agent][1] >= after.get(agent, ("", 0))[1] for agent in final)
            assert final[newcomer][0] == "h2"

            # Every turn, on every host, is in the database; the refused one is not.
            assert stored_messages(state) == {agent: len(history) for agent, history in histories.items()}
        finally:
            hosts.close()
            shutil.rmtree(pg_root, ignore_errors=True)
