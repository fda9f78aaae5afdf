"""The unit tier is what docs/tests.md says it is: no MLX and no PostgreSQL.

Its modules are collected in a process where ``import mlx`` fails, and no test in it
asks for a database server (the ``postgres`` or ``store_url`` fixtures): tests that
need MLX live in tests/integration, tests of the store on both databases in tests/store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Collect tests/unit with MLX blocked; print each collection error and each test that asks
# for a database server's fixture, as JSON.
_COLLECT = """
import json, sys
sys.modules["mlx"] = None
import pytest

class Report:
    def __init__(self):
        self.errors, self.servers = [], []
    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(report.nodeid)
    def pytest_collection_modifyitems(self, items):
        self.servers = [item.nodeid for item in items
                        if {"postgres", "store_url"} & set(getattr(item, "fixturenames", ()))]

report = Report()
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/unit"], plugins=[report])
print("RESULT " + json.dumps({"errors": report.errors, "servers": report.servers}))
"""


def test_the_unit_tier_imports_no_mlx_and_starts_no_database_server() -> None:
    done = subprocess.run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["errors"] == [], f"unit test modules that import MLX (move them to tests/integration): {result}"
    assert result["servers"] == [], f"unit tests that start a database server (move them to tests/store): {result}"
