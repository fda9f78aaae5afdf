"""Stopping child processes: SIGTERM to each, one deadline for all, SIGKILL to any still running."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM every process still running, wait up to ``timeout_s`` in total, then SIGKILL
    (and reap) those that have not exited."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
