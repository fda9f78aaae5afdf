"""Hosts for tests: Linux network namespaces on one bridge, each its own address.

``Hosts(["db", "router", "s1", "s2"])`` makes a bridge in the root namespace (with the
subnet's first address, so the test itself reaches every host by address) and, per host,
a namespace joined to it by a veth pair: loopback up, ``eth0`` with ``10.R.S.(10+i)/24``,
no default route, so the hosts reach one another and the test, nothing else. Commands run
inside a host through ``ip netns exec``; ``close()`` kills every process of every host
(``ip netns pids``) and removes the namespaces and the bridge, whatever happened before.
Needs root (CAP_NET_ADMIN) and ``ip``; ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); CI runs these tests as root"
    probe = f"sm-probe-{secrets.token_hex(3)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"the kernel refused a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    def __init__(self, names: Sequence[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"smbr{self.tag}"
        # A subnet of its own per run (two runs side by side do not collide).
        second, third = 200 + secrets.randbelow(50), secrets.randbelow(250) + 1
        self.prefix = f"10.{second}.{third}"
        self.gateway = f"{self.prefix}.1"
        self.names = list(names)
        self.addresses = {name: f"{self.prefix}.{10 + i}" for i, name in enumerate(self.names)}
        self._made: list[str] = []
        self._bridge_made = False

    def namespace(self, name: str) -> str:
        return f"sm{self.tag}-{name}"

    def _veth(self, name: str) -> str:
        return f"sm{self.tag}{self.names.index(name)}"  # the root side, under 15 characters

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                namespace, veth = self.namespace(name), self._veth(name)
                _ip("netns", "add", namespace)
                self._made.append(namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", namespace)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("link", "set", "lo", "up", namespace=namespace)
                _ip("link", "set", f"{veth}p", "name", "eth0", namespace=namespace)
                _ip("addr", "add", f"{self.addresses[name]}/24", "dev", "eth0", namespace=namespace)
                _ip("link", "set", "eth0", "up", namespace=namespace)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def popen(self, name: str, args: Sequence[str], env: dict[str, str], log_path: Path,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """``args`` inside host ``name`` (``ip netns exec`` execs it: the process is the command)."""
        with log_path.open("ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *args], env=env, cwd=cwd,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, name: str, args: Sequence[str], env: dict[str, str], cwd: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.namespace(name), *args], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def pids(self, name: str) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.namespace(name)], capture_output=True, text=True)
        return [int(pid) for pid in done.stdout.split()]

    def kill_all(self, name: str, wait_s: float = 10) -> None:
        """SIGKILL to every process of host ``name``, as a host that loses power; waits until none is left."""
        deadline = time.monotonic() + wait_s
        while pids := self.pids(name):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of {name} outlived SIGKILL: {pids}")
            time.sleep(0.1)

    def link(self, name: str, up: bool) -> None:
        """Cut (or mend) host ``name``'s link to the bridge."""
        _ip("link", "set", self._veth(name), "up" if up else "down")

    def unreachable(self, name: str, address: str, cut: bool = True) -> None:
        """From host ``name``, ``address`` cannot be reached (a blackhole route), or can again."""
        _ip("route", "add" if cut else "del", "blackhole", f"{address}/32", namespace=self.namespace(name))

    def close(self) -> None:
        for namespace in self._made:
            name = namespace.split("-", 1)[1]
            try:
                self.kill_all(name)
            except RuntimeError:
                pass
            _ip("netns", "del", namespace, check=False)
            # The namespace itself may outlive its name a while (sockets of a cut link still
            # closing): its veth pair goes now, from this end.
            _ip("link", "del", self._veth(name), check=False)
        self._made.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)  # its veth ends went with their namespaces
            self._bridge_made = False
