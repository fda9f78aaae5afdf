"""Entry point of the worker: migrate, then run the Huey consumer."""

from __future__ import annotations

import logging

from app.settings import Settings
from app.store.db import upgrade

log = logging.getLogger(__name__)


def run_worker(settings: Settings, workers: int = 1) -> None:
    upgrade(settings.db_url)
    from worker.huey_app import huey
    from worker.tasks import JOBS

    log.info("worker starting: jobs %s", ", ".join(JOBS))
    huey.create_consumer(workers=workers, periodic=True, flush_locks=True).run()
