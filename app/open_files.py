"""How many files the server may open, and keeping mlx-lm from lowering it.

Each connection is a descriptor, and a Responses WebSocket four (its socket, and the
``websockets`` library's socketpair and selector); the rest of the process (the listener, the
database, cache and model files, pipes) is bounded by ``FD_RESERVE``. At start the server raises
its soft limit (``ulimit -n``) to what its limits may need, or refuses to start, so that no
value of ``max_connections`` or ``max_websockets`` can make it run out of descriptors.

mlx-lm sets the limit to (2048, 4096) when ``mlx_lm.utils`` is imported ("for large models with
lots of files"): a lowered hard limit cannot be raised again by an unprivileged process, so
``import_mlx_lm`` imports it with that call made unable to lower anything.
"""
from __future__ import annotations

import importlib
import resource
import threading

WEBSOCKET_FDS = 4
FD_RESERVE = 512
_IMPORT = threading.Lock()


def open_files_needed(max_connections: int, max_websockets: int) -> int:
    """The open files a server with these limits may need at once."""
    return max_connections + max_websockets * WEBSOCKET_FDS + FD_RESERVE


def allow_open_files(needed: int) -> int:
    """Raise this process's open-files soft limit to ``needed`` if it is below it (the hard limit
    too where the process may); the soft limit in force is returned.

    Raises:
        OSError: the process may not open that many files (its hard limit is lower).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= needed else needed
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, new_hard))
    except (OSError, ValueError) as exc:
        raise OSError(f"the open-files limit is {soft} (hard {hard}) and cannot be raised to {needed}: "
                      f"{exc}") from None
    return needed


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` (and so MLX: load the BLAS first) keeping this process's
    open-files limits: mlx-lm's own call may raise them, never lower them."""
    set_limit = resource.setrlimit

    def never_lower(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            return set_limit(which, limits)
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and wanted > soft:
            set_limit(which, (wanted, hard))  # the soft limit raised, the hard one kept
        return None

    with _IMPORT:
        resource.setrlimit = never_lower  # type: ignore[assignment]
        try:
            importlib.import_module("mlx_lm.utils")
        finally:
            resource.setrlimit = set_limit
