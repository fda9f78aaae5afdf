"""The Huey instance (Huey's convention: one module holds it).

It reads the effective settings once, at import; the worker is its own process, so
this is the process's configuration. With SQLite (one server) the queue is
``huey.db`` beside the store; with PostgreSQL (a pool) it lives in the store's own
database (``PostgresHuey``), so every server of the pool shares one worker's queue
and its job locks.
"""

from __future__ import annotations

from huey import Huey, PostgresHuey, SqliteHuey

from app.settings import load_settings
from app.store.db import is_postgres_url, libpq_dsn

settings = load_settings()
settings.home.mkdir(parents=True, exist_ok=True)
huey: Huey
if is_postgres_url(settings.db_url):
    huey = PostgresHuey("semantic", dsn=libpq_dsn(settings.db_url))
else:
    huey = SqliteHuey("semantic", filename=str(settings.huey_path))
