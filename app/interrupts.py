"""Ctrl-C while serving: the first stops the server now, the second exits at once.

The first SIGINT says what the server waits for, cancels every generation (each client gets
a cancelled end, each request is recorded as cancelled, as when a client leaves) and stops
the HTTP loop; ``serve`` then writes what is queued and returns. A second SIGINT exits with
130 without waiting: ``os._exit``, so no C++ destructor runs beside a thread still in MLX
(that was ``terminate called without an active exception``). SIGTERM keeps its own,
graceful handler (``main.py``).
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.engine import Engine

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a Ctrl-C


class CtrlC:
    """The SIGINT handler of a serving process (``install`` it on the main thread)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._seen = False

    @property
    def seen(self) -> bool:
        """Whether a Ctrl-C came (``serve`` then exits with 130)."""
        return self._seen

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, _signum: int, _frame: FrameType | None) -> None:
        if self._seen:
            log.warning("Ctrl-C again: exiting now (queued cache writes are lost; history is committed)")
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_INTERRUPTED)
        self._seen = True
        status = self._engine.status()
        waiting = status.n_active + status.queue_depth
        if waiting:
            log.warning("Ctrl-C: cancelling %d request(s), then writing queued caches; Ctrl-C again to stop now",
                        waiting)
        else:
            log.warning("Ctrl-C: stopping (writing queued caches); Ctrl-C again to stop now")
        self._engine.cancel_all()
        raise KeyboardInterrupt
