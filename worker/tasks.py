"""Periodic jobs. Each is a few lines around an ``app.store`` function.

The worker never imports ``app.engine`` or MLX.
"""

from __future__ import annotations

from typing import Any

from huey import crontab

from app.store.db import make_engine, make_session_factory
from app.store.jobs import run_compact
from worker.huey_app import huey, settings


@huey.periodic_task(crontab(minute="17"))
def compact() -> dict[str, Any]:
    """Hourly: delete temporary files left by crashes, optimize the database."""
    engine = make_engine(settings.db_url)
    try:
        return run_compact(make_session_factory(engine), settings.blocks_dir)
    finally:
        engine.dispose()


JOBS = {"compact": compact}
