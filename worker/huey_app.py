"""The Huey instance (Huey's convention: one module holds it).

It reads the effective settings once, at import, to find ``huey.db``; the
worker is its own process, so this is the process's configuration.
"""

from __future__ import annotations

from huey import SqliteHuey

from app.settings import load_settings

settings = load_settings()
settings.home.mkdir(parents=True, exist_ok=True)
huey = SqliteHuey("semantic", filename=str(settings.huey_path))
