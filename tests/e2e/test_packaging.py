"""``pip install .`` (not editable) gives a working ``semantic``: the migrations ship inside the package."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_a_plain_install_migrates_a_new_database(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=300)
    assert (target / "app" / "migrations" / "env.py").exists()
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": str(target), "SEMANTIC_HOME": str(home)}
    env.pop("SEMANTIC_CONFIG", None)
    # Run from elsewhere, so only the installed copy can be imported.
    done = subprocess.run([sys.executable, "-c", "import app, sys; print(app.__file__); "
                           "from app.cli import main; sys.exit(main(['jobs', 'run', 'expire']))"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(str(target))
    tables = {row[0] for row in sqlite3.connect(home / "semantic.db").execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    assert {"agents", "messages", "requests", "caches", "agent_turns", "alembic_version"} <= tables
