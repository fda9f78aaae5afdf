"""The API tier runs with MLX unimportable (issue 39 item 1: the surface is sealed for values
too): the fake-engine tests of every protocol pass in a process where ``import mlx`` fails,
so no request path, value type or error the API uses reaches MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parents[1]


def test_the_fake_engine_api_tests_pass_without_mlx() -> None:
    code = ("import sys\n"
            "for name in ('mlx', 'mlx.core', 'mlx_lm'):\n"
            "    sys.modules[name] = None\n"
            "import pytest\n"
            "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', 'api/test_app_with_a_fake_engine.py',"
            " 'api/test_ollama_api.py']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "mlx" not in done.stdout.lower().split("passed")[-1]
