"""`semantic serve` has huge pages for its large buffers where the machine can give them.

A restored working copy is fresh memory, and faulting it in with 4 KiB pages was half the time
of building it (app/huge_pages.py). On Linux with glibc 2.35+ and transparent huge pages on
request ("madvise"), the server starts itself again, the same process, with glibc's tunable;
on any other machine it goes on as it is, and its start log says which and why."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from app.huge_pages import describe, thp_mode, tunables_to_start_with
from support.servers import ServerProcess, start_server, stop_server


def _ready(server: ServerProcess) -> tuple[dict[str, str], int]:
    """The server process's environment and its anonymous huge pages (KiB) once its model is loaded."""
    deadline = time.monotonic() + 120
    while " ready, BLAS" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    proc = Path(f"/proc/{server.process.pid}")
    environ = dict(entry.split("=", 1) for entry in proc.joinpath("environ").read_text().split("\0") if "=" in entry)
    rollup = proc.joinpath("smaps_rollup").read_text()
    huge_kb = int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("AnonHugePages:")))
    return environ, huge_kb


def test_serve_starts_itself_again_with_huge_pages_unless_told_not_to(tmp_path: Path, smollm2_dir: Path) -> None:
    mode = thp_mode()
    asks = tunables_to_start_with({}, mode, platform.libc_ver()) is not None  # this machine can
    server = start_server(tmp_path / "default", smollm2_dir, {"GLIBC_TUNABLES": ""})
    try:
        environ, huge_kb = _ready(server)
    finally:
        stop_server(server)
    assert f"memory: {describe(environ, mode)}" in server.log()
    if asks:
        # The process the test started (its pid) runs with the tunable: it started itself again.
        assert environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
        assert "memory: huge pages on (GLIBC_TUNABLES glibc.malloc.hugetlb=1)" in server.log()
        assert huge_kb > 0, "the model's weights and buffers are in huge pages"
    else:
        assert environ["GLIBC_TUNABLES"] == ""

    # The operator's own choice is kept: no huge pages asked for.
    server = start_server(tmp_path / "off", smollm2_dir, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    try:
        environ, huge_kb_off = _ready(server)
    finally:
        stop_server(server)
    assert environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    assert f"memory: {describe(environ, mode)}" in server.log()
    if asks:
        assert "memory: huge pages off (GLIBC_TUNABLES glibc.malloc.hugetlb=0)" in server.log()
        assert huge_kb_off < huge_kb
