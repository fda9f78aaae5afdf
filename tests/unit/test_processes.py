"""app/processes.py: one deadline for every child, SIGKILL for those that wait out SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

from app.processes import stop_processes

IGNORES_SIGTERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(60)")
OBEYS_SIGTERM = "import sys, time; print('ready', flush=True); time.sleep(60)"


def _start(code: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"  # its handler is set
    return process


def test_one_deadline_for_all_then_sigkill_for_those_still_running() -> None:
    stubborn = [_start(IGNORES_SIGTERM), _start(IGNORES_SIGTERM)]
    obedient = _start(OBEYS_SIGTERM)
    started = time.monotonic()
    stop_processes([*stubborn, obedient], timeout_s=1.0)
    took = time.monotonic() - started
    assert obedient.returncode == -15  # SIGTERM
    assert [p.returncode for p in stubborn] == [-9, -9]  # SIGKILL, reaped
    assert 0.9 < took < 1.9, took  # one shared deadline, not one per process


def test_exited_processes_are_left_alone() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    stop_processes([done], timeout_s=5)
    assert done.returncode == 0
