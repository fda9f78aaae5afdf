"""The Huey worker as a child of ``semantic serve``, so one command runs the whole system.

The child is ``semantic worker`` in its own process (it never imports MLX). It
gets SIGINT with the server on Ctrl-C (same process group), is terminated when
the server stops, and on Linux the kernel kills it if the server dies without
stopping it (``PR_SET_PDEATHSIG``). It runs at a lower priority than the server (niceness
``WORKER_NICENESS``): its start-up (~1 CPU second of imports) and its jobs yield the cores to
the model's load and to requests. Deployments that supervise the worker themselves run
``semantic serve --no-worker``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import signal
import subprocess
import sys

from app.processes import stop_processes
from app.settings import Settings, as_environment

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


WORKER_NICENESS = 10  # below the server: its housekeeping never takes a core from a start, a prefill or a decode


def _child_setup() -> None:  # runs in the child, between fork and exec
    os.nice(WORKER_NICENESS)
    if platform.system() == "Linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_worker(settings: Settings) -> subprocess.Popen[bytes]:
    """Start ``semantic worker`` with the server's settings (``serve``'s flags included)."""
    process = subprocess.Popen([sys.executable, "-m", "app", "worker"], env={**os.environ, **as_environment(settings)},
                               preexec_fn=_child_setup)
    log.info("worker started (pid %d): expire, evict and compact run on their schedules", process.pid)
    return process


def stop_worker(process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    """Terminate the worker and wait for it (killed if it does not stop in time)."""
    stop_processes([process], timeout_s)
    log.info("worker stopped (exit %s)", process.returncode)
