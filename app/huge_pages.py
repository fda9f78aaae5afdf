"""Transparent huge pages for the server's large buffers (Linux with glibc).

A restored conversation's working copy is fresh memory: 1 GiB at 16K tokens of a 1B-class
model. Faulted in 4 KiB pages, it was about half the time of building it on the CPU
(``benchmarks.restore``; docs/benchmarks.md, "Measured choices in the code").
MLX allocates its arrays with ``malloc``. glibc 2.35 and later backs large allocations with
transparent huge pages when the tunable ``glibc.malloc.hugetlb=1`` is set.

Tunables are read when a process starts, so ``semantic serve`` starts itself again (``exec``:
the same process id, before any thread or model) with the tunable added. It does so where the
kernel gives huge pages to memory that asks for them (``transparent_hugepage/enabled`` is
``madvise``). Where it is ``always``, every process has them already; where it is ``never``,
no process can. An operator's own setting of the tunable in ``GLIBC_TUNABLES`` is kept: ``=0``
turns this off.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TUNABLE = "glibc.malloc.hugetlb"
GLIBC_WITH_TUNABLE = (2, 35)


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or None
    where there is none to read (not Linux, or a kernel without them)."""
    try:
        chosen = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def _glibc(libc: tuple[str, str]) -> tuple[int, ...] | None:
    """glibc's version from ``platform.libc_ver()``, or None for another C library."""
    name, version = libc
    if name != "glibc":
        return None
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def tunables_to_start_with(environ: Mapping[str, str], mode: str | None,
                           libc: tuple[str, str]) -> str | None:
    """The ``GLIBC_TUNABLES`` value to start again with, huge pages added; None to go on as
    the process is (they are on already, cannot be had, or the operator set the tunable)."""
    current = environ.get("GLIBC_TUNABLES", "")
    version = _glibc(libc)
    if mode != "madvise" or version is None or version < GLIBC_WITH_TUNABLE or TUNABLE in current:
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def start_with_huge_pages() -> None:
    """Start this command again with huge pages for large allocations, where that changes
    anything (``tunables_to_start_with``); returns only where it does not."""
    if sys.platform != "linux" or not sys.executable:  # an embedded interpreter cannot start itself
        return
    tunables = tunables_to_start_with(os.environ, thp_mode(), platform.libc_ver())
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": tunables})
    except OSError:  # the interpreter's file is gone (an upgrade under a running shell): go on as it is
        return


def describe(environ: Mapping[str, str], mode: str | None) -> str:
    """Whether a process of ``environ`` on a kernel of THP ``mode`` (``thp_mode``) has huge
    pages for its large allocations, and why: for the start log."""
    if mode == "always":
        return "huge pages on (the kernel's transparent_hugepage is 'always')"
    if mode != "madvise":
        return "huge pages off (the kernel has no transparent huge pages)" if mode is None else \
            f"huge pages off (the kernel's transparent_hugepage is '{mode}')"
    setting = re.search(rf"{re.escape(TUNABLE)}=(\d+)", environ.get("GLIBC_TUNABLES", ""))
    if setting is None:
        return f"huge pages off (GLIBC_TUNABLES does not set {TUNABLE}, which glibc 2.35 or later has)"
    return f"huge pages {'on' if setting.group(1) != '0' else 'off'} (GLIBC_TUNABLES {setting.group(0)})"
