"""A PostgreSQL cluster of its own, in a directory: the shared store of a local pool.

``initdb`` refuses to run as root, so as root the cluster belongs to the ``postgres``
user (Debian's packages create it) and its commands run through ``runuser``. The
cluster listens on loopback only and on a unix socket in its own directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from app.errors import ConfigError

SUPERUSER = "semantic"


def _bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are: ``pg_config --bindir``, else the PATH."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        bindir = Path(subprocess.check_output([pg_config, "--bindir"], text=True).strip())
        if (bindir / "initdb").exists():
            return bindir
    initdb = shutil.which("initdb")
    if initdb is None:
        raise ConfigError("PostgreSQL is not installed (initdb not found): apt-get install postgresql, "
                          "or set SEMANTIC_DATABASE_URL to an existing server")
    return Path(initdb).parent


@dataclass(frozen=True, slots=True)
class LocalPostgres:
    """A cluster in ``root`` (``root/data``, its log and socket beside it) on ``port``."""

    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*as_owner, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"{Path(args[0]).name} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")

    def start(self, durable: bool = True) -> None:
        """Create the cluster on first use, then start it. ``durable=False`` (tests)
        turns off fsync: a crash of the machine may lose the cluster."""
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.root.chmod(0o700)
        bindir = _bindir()
        if not (self.data / "PG_VERSION").exists():
            self._run(str(bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", SUPERUSER,
                      "-E", "UTF8", "--no-instructions", *([] if durable else ["--no-sync"]))
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root}"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-w",
                  "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the cluster (``immediate`` skips the checkpoint, as a crash would)."""
        self._run(str(_bindir() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname=postgres",
                             autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
