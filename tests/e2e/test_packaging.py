"""``pip install .`` (not editable) gives a working ``semantic``: the migrations and the pages'
templates ship inside the package."""

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
    templates = ROOT / "app" / "api" / "templates"
    assert all((target / p.relative_to(ROOT)).is_file() for p in templates.iterdir()), list(templates.iterdir())
    [license_file] = target.glob("semantic-*.dist-info/licenses/LICENSE")  # pyproject's license = "Apache-2.0"
    assert "Apache License\n                           Version 2.0" in license_file.read_text()
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


def test_the_bench_extra_has_what_the_benchmark_helpers_import() -> None:
    """`pip install 'semantic[bench]'` (with the machine's MLX extra) runs benchmarks/common.py."""
    import ast
    import tomllib
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    provided = {canonicalize_name(Requirement(r).name)
                for r in (*project["dependencies"], *extras["bench"], *extras["cpu"])}
    tree = ast.parse((ROOT / "benchmarks" / "common.py").read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    third_party = modules - set(sys.stdlib_module_names) - {"__future__", "app"}
    distributions = packages_distributions()
    # A module not installed here (the bench extra is not in CI's venv) is named by its distribution.
    missing = {m for m in third_party if not {canonicalize_name(d) for d in distributions.get(m, [m])} & provided}
    assert third_party >= {"httpx", "matplotlib", "mlx"} and not missing, missing
