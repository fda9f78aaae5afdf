"""``semantic pool up | status | down``: a pool of servers on this machine, as one.

``up`` starts, on loopback: a PostgreSQL cluster of its own (unless ``database_url``
names one), an S3 server for the shared block tier (SeaweedFS, unless ``block_store``
names a bucket), the servers one after another (each its own home under
``$SEMANTIC_HOME/pool/servers``, sharing the models directory and the database), one
worker for all of them, and HAProxy in front; then it stays in the foreground until
SIGTERM or Ctrl-C, which stop everything. ``pool/state.json`` says what runs where, for
``status`` and ``down``. Each part is a URL or a setting, so a pool over several
machines uses the same pieces started by hand (docs/pool.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from app.errors import ConfigError
from app.pool.haproxy import Backend, RuntimeAPI, haproxy_binary, render_config
from app.pool.postgres import LocalPostgres
from app.pool.seaweed import LocalS3
from app.pool.secrets import pool_secrets
from app.processes import stop_processes
from app.redaction import redact
from app.settings import Settings, as_environment, variable_of

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
# A server's SIGTERM finishes the requests it runs, then writes its queued caches (up to
# FLUSH_ON_CLOSE_S + STOP_ON_CLOSE_S, app/cache/persist.py) and releases its agents: a stop
# waits this long before SIGKILL (before: 30 s, which killed a server still flushing to a slow
# tier, its agents unreleased).
STOP_TIMEOUT_S = 90.0


@dataclass(frozen=True, slots=True)
class ServerEntry:
    id: str
    url: str
    pid: int
    home: str


@dataclass(frozen=True, slots=True)
class PoolState:
    pid: int  # the `pool up` process
    router: str
    database_url: str
    block_store: str
    postgres_dir: str | None  # the cluster `pool up` runs, if it runs one
    servers: list[ServerEntry]
    admin_socket: str  # the router's runtime API
    server_env: dict[str, str]  # what every server of the pool is started with (a joining one too)


def pool_dir(settings: Settings) -> Path:
    return settings.home / "pool"


def _state_path(settings: Settings) -> Path:
    return pool_dir(settings) / "state.json"


def read_state(settings: Settings) -> PoolState | None:
    try:
        data = json.loads(_state_path(settings).read_text())
    except (OSError, ValueError):
        return None
    return PoolState(**{**data, "servers": [ServerEntry(**s) for s in data["servers"]]})


# Settings each server or the worker of a pool gets of its own, never the home's.
PER_PROCESS_SETTINGS = ("home", "host", "port", "server_id", "worker", "database_url", "block_store", "compact_dirs")


def pool_environment(settings: Settings) -> dict[str, str]:
    """The home's effective settings (its config.toml, the environment, the flags) as the
    ``SEMANTIC_*`` variables every server and the worker of the pool start with: the pool's
    servers take no config file, so without these a keyed home's router would serve every
    agent without a key, and the worker would expire caches on other TTLs than the servers'."""
    skipped = {variable_of(name) for name in PER_PROCESS_SETTINGS}
    return {name: value for name, value in as_environment(settings).items() if name not in skipped}


def _postgres_root(settings: Settings) -> Path:
    """As root the cluster belongs to the ``postgres`` user, who cannot enter a private
    home: it lives in that user's own directory, named after the home."""
    if os.geteuid() != 0:
        return pool_dir(settings) / "postgres"
    tag = hashlib.sha256(str(settings.home.resolve()).encode()).hexdigest()[:12]
    return Path(pwd.getpwnam("postgres").pw_dir) / f"semantic-pool-{tag}"


def _healthy(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _wait_ready(url: str, process: subprocess.Popen[bytes], what: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ConfigError(f"{what} exited with {process.returncode}; see {log_path}")
        health = _healthy(url)
        if health is not None and health.get("status") == "ok":
            return
        time.sleep(0.3)
    raise ConfigError(f"{what} was not ready after {READY_TIMEOUT_S:.0f} s; see {log_path}")


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    stop_processes(processes, STOP_TIMEOUT_S)


def _port_plan(settings: Settings, n_servers: int, port: int) -> list[tuple[int, str]]:
    """The loopback ports ``pool up --port PORT`` listens on, each with what takes it."""
    plan = [(port, "the router"), *((port + i, f"server s{i}") for i in range(1, n_servers + 1))]
    if not settings.database_url:
        plan.append((port + n_servers + 1, "the pool's PostgreSQL"))
    if not settings.block_store:
        plan += [(port + n_servers + 2 + i, "the pool's S3 tier (SeaweedFS)") for i in range(LocalS3.N_PORTS)]
    return plan


def _check_ports(plan: list[tuple[int, str]]) -> None:
    """Refuse, naming the port and its use, when one of ``plan``'s is taken (before: a
    taken PostgreSQL port surfaced as pg_ctl's "PID file does not exist")."""
    if plan[-1][0] > 65535:
        raise ConfigError(f"--port {plan[0][0]}: the pool needs ports up to {plan[-1][0]}, past 65535")
    for number, use in plan:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no use
            try:
                probe.bind(("127.0.0.1", number))
            except OSError:
                raise ConfigError(f"port {number} ({use}) is in use on 127.0.0.1: the pool takes ports "
                                  f"{plan[0][0]}-{plan[-1][0]}; choose another --port") from None


def pool_up(settings: Settings, n_servers: int, port: int, routing: str = "affinity") -> int:
    """Start the pool and supervise it until SIGTERM / SIGINT; returns the exit status."""
    if n_servers < 1:
        raise ConfigError("--servers: at least 1")
    running = read_state(settings)
    if running is not None and _alive(running.pid):
        raise ConfigError(f"a pool already runs from {settings.home} (pid {running.pid}, router {running.router})")
    _check_ports(_port_plan(settings, n_servers, port))
    root = pool_dir(settings)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    haproxy = haproxy_binary()
    children: list[subprocess.Popen[bytes]] = []
    stores: list[subprocess.Popen[bytes]] = []  # stopped after the servers, which flush to them
    cluster: LocalPostgres | None = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    keys = pool_secrets(root / "secrets.json")
    try:
        database_url = settings.database_url
        if not database_url:
            cluster = LocalPostgres(_postgres_root(settings), port + n_servers + 1, keys.postgres_password)
            print(f"postgres  starting in {cluster.root}", flush=True)
            cluster.start()
            database_url = cluster.url("postgres")
        print(f"database  {redact(database_url)}  (SEMANTIC_DATABASE_URL for `semantic sql` and other tools)",
              flush=True)
        base = {**os.environ, **pool_environment(settings), "SEMANTIC_DATABASE_URL": database_url}
        base.pop("SEMANTIC_CONFIG", None)
        block_store = settings.block_store
        if not block_store:
            s3 = LocalS3(root / "s3", port + n_servers + 2, keys.s3_access_key, keys.s3_secret_key)
            stores.append(s3.start(root / "logs" / "s3.log"))
            block_store = s3.block_store
            base.update(s3.credentials)
            print(f"s3        SeaweedFS on {s3.endpoint} (objects in {s3.root})", flush=True)
        base["SEMANTIC_BLOCK_STORE"] = block_store
        servers: list[ServerEntry] = []
        for i in range(1, n_servers + 1):  # one after another: the first imports the model for all
            process, entry = _start_server(settings, f"s{i}", port + i, base)
            children.append(process)
            servers.append(entry)
        children.append(_spawn([sys.executable, "-m", "app", "worker"],
                               {**base, "SEMANTIC_HOME": str(settings.home),
                                "SEMANTIC_COMPACT_DIRS": str(root / "servers" / "*" / "blocks")},  # joined ones too
                               root / "logs" / "worker.log"))
        config = root / "haproxy.cfg"
        config.write_text(render_config(port, [Backend(s.id, "127.0.0.1", int(s.url.rsplit(":", 1)[1]))
                                               for s in servers], str(root / "haproxy.sock"), routing=routing))
        router = _spawn([haproxy, "-db", "-f", str(config)], dict(os.environ), root / "logs" / "haproxy.log")
        children.append(router)
        router_url = f"http://127.0.0.1:{port}"
        _wait_ready(router_url, router, "the router (HAProxy)", root / "logs" / "haproxy.log")
        state = PoolState(os.getpid(), router_url, database_url, block_store, str(cluster.root) if cluster else None,
                          servers, str(root / "haproxy.sock"),
                          {k: v for k, v in base.items() if k.startswith(("SEMANTIC_", "AWS_"))})
        _write_state(settings, state)
        print(f"pool      {n_servers} server(s) behind {router_url}, {routing} routing  "
              "(semantic pool status; Ctrl-C stops)", flush=True)
        _supervise([*stores, *children])
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        joined = read_state(settings)  # servers `pool join` started since are stopped too
        if joined is not None and joined.pid == os.getpid():
            _stop_pids([e.pid for e in joined.servers if e.pid not in {c.pid for c in children}])
        _stop(list(reversed(children)))
        _stop(stores)
        _state_path(settings).unlink(missing_ok=True)
        if cluster is not None:
            cluster.stop()
        print("pool      stopped", flush=True)


def _start_server(settings: Settings, server_id: str, port: int,
                  base: dict[str, str]) -> tuple[subprocess.Popen[bytes], ServerEntry]:
    """Start one server of the pool (its own home, the shared models) and wait until it is ready."""
    root = pool_dir(settings)
    home = root / "servers" / server_id
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        settings.models_dir.mkdir(parents=True, exist_ok=True)
        (home / "models").symlink_to(settings.models_dir.resolve(), target_is_directory=True)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **base, "SEMANTIC_HOME": str(home), "SEMANTIC_HOST": "127.0.0.1",
           "SEMANTIC_PORT": str(port), "SEMANTIC_SERVER_ID": server_id, "SEMANTIC_WORKER": "0"}
    env.pop("SEMANTIC_CONFIG", None)
    log_path = root / "logs" / f"{server_id}.log"
    process = _spawn([sys.executable, "-m", "app", "serve"], env, log_path)
    print(f"server    {server_id} starting on {url} (log {log_path})", flush=True)
    try:
        _wait_ready(url, process, f"server {server_id}", log_path)
    except BaseException:
        _stop([process])
        raise
    return process, ServerEntry(server_id, url, process.pid, str(home))


def _write_state(settings: Settings, state: PoolState) -> None:
    """state.json, readable by its owner only: ``server_env`` holds the pool's secrets (api_key)."""
    partial = _state_path(settings).with_suffix(".tmp")
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(json.dumps(asdict(state), indent=2))
    partial.replace(_state_path(settings))


def _running(settings: Settings) -> PoolState:
    state = read_state(settings)
    if state is None or not _alive(state.pid):
        raise ConfigError(f"no pool runs from {settings.home} (semantic pool up)")
    return state


def pool_join(settings: Settings) -> ServerEntry:
    """Start one more server and add it to the running router: it takes new agents, and no
    agent already placed moves (the router's stick table keeps them where their cache is)."""
    state = _running(settings)
    taken = {s.id for s in state.servers}
    server_id = next(f"s{i}" for i in range(1, len(taken) + 2) if f"s{i}" not in taken)
    with socket.socket() as probe:  # a free port: those after the router's are the pool's stores'
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    _, entry = _start_server(settings, server_id, port, state.server_env)
    RuntimeAPI(state.admin_socket).add_server(Backend(server_id, "127.0.0.1", port))
    current = _running(settings)  # read again: the state may have changed while the server started
    _write_state(settings, replace(current, servers=[*current.servers, entry]))
    return entry


def _host_path(settings: Settings) -> Path:
    """The servers ``pool join --router`` started from this home (for ``pool drain --router``)."""
    return pool_dir(settings) / "host.json"


def _host_servers(settings: Settings) -> list[ServerEntry]:
    try:
        return [ServerEntry(**s) for s in json.loads(_host_path(settings).read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _write_host_servers(settings: Settings, servers: list[ServerEntry]) -> None:
    _host_path(settings).parent.mkdir(parents=True, exist_ok=True)
    partial = _host_path(settings).with_suffix(".tmp")
    partial.write_text(json.dumps([asdict(s) for s in servers], indent=2))
    partial.replace(_host_path(settings))


def _address(value: str, what: str) -> tuple[str, int]:
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def pool_join_router(settings: Settings, router: str, address: str) -> ServerEntry:
    """Join the pool whose router's runtime API is at ``router`` (``HOST:PORT``, over TCP) from
    this machine: the server at ``address`` (how the router reaches it) is added to the router;
    if none answers there, one is started first (``semantic serve --host 0.0.0.0`` on that
    port, this home and environment: the pool's database, tier and keys, its ``server_id``),
    and it runs on after ``join`` returns."""
    host, port = _address(address, "--address")
    url = f"http://{host}:{port}"
    health = _healthy(url)
    if health is None:
        if not settings.database_url or not settings.block_store:
            raise ConfigError("a server joining a pool needs the pool's database and shared tier: "
                              "set SEMANTIC_DATABASE_URL and SEMANTIC_BLOCK_STORE (docs/pool.md)")
        server_id = settings.effective_server_id
        logs = settings.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"serve-{server_id}.log"
        env = {**os.environ, "SEMANTIC_HOME": str(settings.home), "SEMANTIC_HOST": "0.0.0.0",
               "SEMANTIC_PORT": str(port), "SEMANTIC_SERVER_ID": server_id, "SEMANTIC_WORKER": "0"}
        process = _spawn([sys.executable, "-m", "app", "serve"], env, log_path)
        print(f"server    {server_id} starting on 0.0.0.0:{port} (log {log_path})", flush=True)
        try:
            _wait_ready(url, process, f"server {server_id}", log_path)
        except BaseException:
            _stop([process])
            raise
        entry = ServerEntry(server_id, url, process.pid, str(settings.home))
        _write_host_servers(settings, [*(s for s in _host_servers(settings) if s.id != server_id), entry])
    elif health.get("status") != "ok":
        raise ConfigError(f"the server at {url} is not ready ({health.get('status')})")
    else:
        entry = ServerEntry(str(health["server_id"]), url, 0, "")
    RuntimeAPI(router).add_server(Backend(entry.id, host, port))
    return entry


def pool_drain_router(settings: Settings, server_id: str, router: str) -> bool:
    """Take a server out of the router whose runtime API is at ``router`` (``HOST:PORT``): it gets
    no new request; if ``pool join --router`` started it from this home, it is then stopped as
    SIGTERM stops a server (flushed, its agents released). Returns whether it was stopped here
    (else stopping it is its operator's: systemctl stop, or SIGTERM)."""
    RuntimeAPI(router).set_state(server_id, "maint")
    mine = [s for s in _host_servers(settings) if s.id == server_id and _alive(s.pid)]
    if not mine:
        return False
    _stop_pids([s.pid for s in mine])
    if any(_alive(s.pid) for s in mine):
        raise ConfigError(f"server {server_id} did not stop within {STOP_TIMEOUT_S:.0f} s: killed (see its log)")
    _write_host_servers(settings, [s for s in _host_servers(settings) if s.id != server_id])
    return True


def pool_drain(settings: Settings, server_id: str) -> None:
    """Take a server out: the router sends it nothing new (its agents go elsewhere at their
    next turn), then it stops as SIGTERM stops a server: the requests it runs finish, its
    caches are written to disk and the shared tier, and it releases the agents it owns."""
    state = _running(settings)
    entry = next((s for s in state.servers if s.id == server_id), None)
    if entry is None:
        raise ConfigError(f"no server {server_id!r} in the pool ({', '.join(s.id for s in state.servers)})")
    RuntimeAPI(state.admin_socket).set_state(server_id, "maint")
    _stop_pids([entry.pid])
    if _alive(entry.pid):
        raise ConfigError(f"server {server_id} (pid {entry.pid}) did not stop within {STOP_TIMEOUT_S:.0f} s: "
                          "killed (see its log)")
    current = _running(settings)
    _write_state(settings, replace(current, servers=[s for s in current.servers if s.id != server_id]))


def _stop_pids(pids: list[int]) -> None:
    """SIGTERM to processes that are not our children, then wait (SIGKILL at the deadline)."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _supervise(children: list[subprocess.Popen[bytes]]) -> None:
    """Report children that exit (a killed server is the router's to route around)."""
    reported: set[int] = set()
    while True:
        for child in children:
            if child.poll() is not None and child.pid not in reported:
                reported.add(child.pid)
                command: list[Any] = list(child.args)  # type: ignore[arg-type]  # a list of arguments here
                print(f"pool      process {child.pid} ({' '.join(map(str, command[-2:]))}) exited with "
                      f"{child.returncode}", flush=True)
        time.sleep(1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pool_status(settings: Settings) -> list[dict[str, Any]]:
    """Each server: id, url, pid, healthy, and the agents and conversations it holds in memory."""
    state = _running(settings)
    rows = []
    for server in state.servers:
        health = _healthy(server.url) if _alive(server.pid) else None
        cache = (health or {}).get("cache") or {}
        rows.append({"id": server.id, "url": server.url, "pid": server.pid,
                     "healthy": bool(health and health.get("status") == "ok"),
                     "agents_hot": cache.get("agents", {}).get("hot", 0),
                     "conversations": cache.get("conversations", {})})
    return rows


def pool_down(settings: Settings) -> None:
    """Stop the pool that ``up`` runs from this home, and wait for it."""
    state = read_state(settings)
    if state is None or not _alive(state.pid):
        raise ConfigError(f"no pool runs from {settings.home}")
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S * 2
    while _alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(state.pid):
        raise ConfigError(f"the pool (pid {state.pid}) did not stop within {STOP_TIMEOUT_S * 2:.0f} s")
