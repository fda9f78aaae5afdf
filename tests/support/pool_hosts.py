"""A pool over hosts (tests/support/netns.py), as docs/pool.md's "Several machines" runs it:
PostgreSQL, the S3 tier (SeaweedFS) and the worker on ``store``, HAProxy on ``router``
(``semantic pool router-config``, its runtime API over TCP on the router's address), and
``semantic serve --host 0.0.0.0 --no-worker`` with an API key on each server host, every
part reaching the others by address. Hosts named in ``later`` get a namespace but nothing
runs there until ``join``. Used by tests/e2e/test_pool_hosts.py and benchmarks/pool_hosts.py.

    with PoolHosts(tmp, smollm2_dir, ["h1", "h2"], later=["h3"]) as pool:
        httpx.post(f"{pool.router}/v1/messages", headers={"x-api-key": KEY, ...}, ...)
        pool.kill("h1")
        pool.join("h3")
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.pool.postgres import LocalPostgres
from app.pool.seaweed import LocalS3
from app.store.db import make_engine
from support.netns import Hosts, unavailable

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000  # every server on its own host's port 8000, as on real machines
ADMIN_PORT = 9999
KEY = "pool-hosts-key"  # servers bound to 0.0.0.0 ask for one


def missing() -> str | None:
    """Why a pool over hosts cannot run here (None: it can)."""
    for tool in ("haproxy", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return unavailable()


def owners(database_url: str) -> dict[str, tuple[str, int]]:
    """agent -> (owning server, epoch), from the pool's database."""
    engine = make_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return {agent: (server, epoch) for agent, server, epoch in
                    connection.execute(text("SELECT agent_id, server_id, epoch FROM owners"))}
    finally:
        engine.dispose()


def messages_per_agent(database_url: str) -> dict[str, int]:
    """Messages per agent in the pool's database."""
    engine = make_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return dict(connection.execute(text("SELECT agent_id, count(*) FROM messages GROUP BY agent_id")).all())
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


class PoolHosts:
    def __init__(self, root: Path, model_dir: Path, servers: Sequence[str], later: Sequence[str] = ()) -> None:
        self.root, self.model_dir = root, model_dir
        self.servers, self.later = list(servers), list(later)
        self.logs = root / "logs"
        self.hosts = Hosts(["store", "router", *self.servers, *self.later])
        self.address = self.hosts.addresses
        self.admin = f"{self.address['router']}:{ADMIN_PORT}"
        self.router = f"http://{self.address['router']}:{PORT}"
        self.base = {k: v for k, v in os.environ.items() if not k.startswith("SEMANTIC_")}
        self._pg_root: Path | None = None

    def __enter__(self) -> Self:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.hosts.__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _start(self) -> None:
        address, hosts = self.address, self.hosts
        # The store host: PostgreSQL and the S3 tier on its address, and the pool's worker.
        self._pg_root = Path(tempfile.mkdtemp(prefix="semantic-pg-hosts-"))
        self._pg_root.chmod(0o755)  # the postgres user enters it
        cluster = LocalPostgres(self._pg_root / "pg", 5432, secrets.token_urlsafe(16), host=address["store"])
        made = hosts.run("store", [sys.executable, "-c", ("import sys; from pathlib import Path; "
                                   "from app.pool.postgres import LocalPostgres as P; "
                                   "c = P(Path(sys.argv[1]), 5432, sys.argv[2], host=sys.argv[3]); "
                                   "c.start(durable=False); c.create_database('pool')"),
                                   str(cluster.root), cluster.password, cluster.host], self.base, cwd=ROOT)
        if made.returncode != 0:
            raise RuntimeError(made.stderr)
        self.database_url = cluster.url("pool")
        s3 = LocalS3(self.root / "s3", 8333, ip=address["store"])
        self.credentials = s3.credentials
        self.block_store = s3.block_store
        s3.wait_ready(hosts.popen("store", s3.command(), {**self.base, **s3.credentials}, self.logs / "s3.log"),
                      self.logs / "s3.log")
        self.pool_env = {**self.base, "SEMANTIC_DATABASE_URL": self.database_url,
                         "SEMANTIC_BLOCK_STORE": s3.block_store, **s3.credentials,
                         "SEMANTIC_MODEL": self.model_dir.name, "SEMANTIC_API_KEY": KEY}

        first, *rest = self.servers
        self.wait_healthy(first, self.serve(first))  # the first migrates the database
        started = {name: self.serve(name) for name in rest}
        hosts.popen("store", [sys.executable, "-m", "app", "worker"], self.host_env("store"),
                    self.logs / "worker.log", cwd=ROOT)
        for name, process in started.items():
            self.wait_healthy(name, process)

        # The router host: HAProxy from `pool router-config`, its runtime API on its own address.
        config = hosts.run("router", [sys.executable, "-m", "app", "pool", "router-config",
                                      *[a for name in self.servers for a in ("--server", f"{name}={self.address[name]}:{PORT}")],
                                      "--bind", address["router"], "--port", str(PORT),
                                      "--admin-socket", self.admin], self.base, cwd=ROOT)
        if config.returncode != 0:
            raise RuntimeError(config.stderr)
        self.router_config = config.stdout
        (self.root / "haproxy.cfg").write_text(config.stdout)
        haproxy = hosts.popen("router", ["haproxy", "-db", "-f", str(self.root / "haproxy.cfg")], self.base,
                              self.logs / "haproxy.log")
        wait_healthy(self.router, "the router", self.logs / "haproxy.log", haproxy, timeout_s=30)

    def url(self, name: str) -> str:
        return f"http://{self.address[name]}:{PORT}"

    def host_env(self, name: str) -> dict[str, str]:
        """The environment of Semantic on host ``name``: its own home, the pool's database and tier."""
        home = self.root / name
        home.mkdir(exist_ok=True)
        if not (home / "models").exists():
            (home / "models").symlink_to(self.model_dir.parent, target_is_directory=True)
        return {**self.pool_env, "SEMANTIC_HOME": str(home), "SEMANTIC_SERVER_ID": name}

    def serve(self, name: str) -> subprocess.Popen[bytes]:
        return self.hosts.popen(name, [sys.executable, "-m", "app", "serve", "--host", "0.0.0.0", "--port", str(PORT),
                                       "--no-worker"], self.host_env(name), self.logs / f"{name}.log", cwd=ROOT)

    def wait_healthy(self, name: str, process: subprocess.Popen[bytes]) -> None:
        wait_healthy(self.url(name), name, self.logs / f"{name}.log", process)

    def join(self, name: str) -> subprocess.CompletedProcess[str]:
        """``semantic pool join --router`` on host ``name``: a server started there, in the router."""
        return self.hosts.run(name, [sys.executable, "-m", "app", "pool", "join", "--router", self.admin,
                                     "--address", f"{self.address[name]}:{PORT}", "--id", name],
                              self.host_env(name), cwd=ROOT)

    def drain(self, name: str) -> subprocess.CompletedProcess[str]:
        return self.hosts.run(name, [sys.executable, "-m", "app", "pool", "drain", name, "--router", self.admin],
                              self.host_env(name), cwd=ROOT)

    def kill(self, name: str) -> None:
        """Host ``name`` fails: every process of it killed, its link cut."""
        self.hosts.kill_all(name)
        self.hosts.link(name, up=False)

    def owners(self) -> dict[str, tuple[str, int]]:
        return owners(self.database_url)

    def close(self) -> None:
        self.hosts.close()
        if self._pg_root is not None:
            shutil.rmtree(self._pg_root, ignore_errors=True)
            self._pg_root = None
