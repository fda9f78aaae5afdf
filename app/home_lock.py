"""One ``semantic serve`` per ``SEMANTIC_HOME``.

Each server keeps its own block pool over the home's ``blocks/``; two would free and
overwrite each other's cache files. ``serve.lock`` (an OS file lock: the kernel releases
it when the process dies, ``kill -9`` included) is held while serving, and ``serve.json``
beside it names the holder for a second server's refusal. The worker and the commands
that only read (status, sql, config, models list) take no lock and run beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from app.errors import ConfigError
from app.settings import Settings

LOCK_FILE = "serve.lock"
OWNER_FILE = "serve.json"


@contextmanager
def serving(settings: Settings) -> Iterator[None]:
    """Hold the home's serve lock, with its holder written beside it, for the block's duration.

    Raises:
        ConfigError: another process serves this home (its pid and port named).
    """
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    lock = FileLock(home / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(f"{home} is already served by another semantic serve{_holder(home)}; stop it first, "
                          "or give this one its own SEMANTIC_HOME") from None
    owner = home / OWNER_FILE
    try:
        owner.write_text(json.dumps({"pid": os.getpid(), "host": settings.host, "port": settings.port}))
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def serving_address(home: Path) -> tuple[str, int] | None:
    """The host and port the process serving ``home`` listens on (its ``serve.json``), or
    None when none serves it (or it has not written its address yet)."""
    try:
        owner = json.loads((home / OWNER_FILE).read_text())
        return str(owner["host"]), int(owner["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _holder(home: Path) -> str:
    """`` (pid N, port P)``, or nothing while the holder has not written it yet."""
    try:
        owner = json.loads((home / OWNER_FILE).read_text())
        return f" (pid {int(owner['pid'])}, port {int(owner['port'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
