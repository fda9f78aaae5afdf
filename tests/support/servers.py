"""Real servers for the tests: ``semantic serve`` started as a process on a free port and
waited for, and the environment a headless Claude Code needs to talk to one."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    """Headless Claude Code talking to ``base_url`` only (CLAUDE_CODE.md)."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "dummy-key", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports, below the kernel's ephemeral range
    (from 32768): a block after ``free_port()``'s port lies in that range, where any outgoing
    connection may take one of its ports before the process that needs it listens (a pool's
    PostgreSQL failed to bind so, one run in a few)."""
    for _ in range(200):
        base = random.randrange(20000, 32768 - n)
        probes = [socket.socket() for _ in range(n)]
        try:
            for i, probe in enumerate(probes):
                probe.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32767")


@dataclass
class ServerProcess:
    url: str
    home: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def db_path(self) -> Path:
        return self.home / "semantic.db"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _keep_earlier_log(log_path: Path) -> None:
    """Move an earlier start's log in this home aside: ``server.log`` is this start's alone,
    ``server.log.1`` the first start's, ``.2`` the next (a restart's turn is read against the
    log of the server it restarted)."""
    if log_path.exists() and log_path.stat().st_size:
        n = 1
        while log_path.with_name(f"{log_path.name}.{n}").exists():
            n += 1
        log_path.rename(log_path.with_name(f"{log_path.name}.{n}"))


def start_server(home: Path, model: Path | str | None, extra_env: dict[str, str] | None = None,
                 timeout_s: float = 180) -> ServerProcess:
    """Start `semantic serve --model MODEL` (a directory, or any name `--model` takes; None:
    no model named, the default) as a real process on a free port and wait for /health."""
    port = free_port()
    # The worker child is off unless a test asks for it (it is tested on its own).
    env = {**os.environ, "SEMANTIC_HOME": str(home), "SEMANTIC_PORT": str(port), "SEMANTIC_WORKER": "0",
           **(extra_env or {})}
    env.pop("SEMANTIC_CONFIG", None)
    if model is None:
        env.pop("SEMANTIC_MODEL", None)
    log_path = home / "server.log"
    home.mkdir(parents=True, exist_ok=True)
    _keep_earlier_log(log_path)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", *(["--model", str(model)] if model is not None else [])],
            cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", home, process, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
