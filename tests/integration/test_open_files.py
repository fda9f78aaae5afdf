"""The open-files limit a server may need (issue 59, item 1): no value of ``max_connections`` or
``max_websockets`` can make the server run out of descriptors. Each case is a fresh process
whose limits are set before it starts.

* mlx-lm lowers the limit to (2048, 4096) when imported; through ``import_mlx_lm`` the hard
  limit is kept, so a server that needs more may still raise its soft limit.
* ``semantic serve`` raises its soft limit to what its limits need at start, and where the hard
  limit is lower it refuses to start with a one-line error naming both settings.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from support.servers import free_port


def limited(soft: int, hard: int):  # type: ignore[no-untyped-def]
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limits_after(code: str, soft: int, hard: int) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport resource\n"
                           "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, preexec_fn=limited(soft, hard))
    assert done.returncode == 0, done.stderr
    low, high = done.stdout.split()[-2:]
    return int(low), int(high)


def test_mlx_lm_imported_through_import_mlx_lm_keeps_the_hard_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 4096, "this machine's hard limit is too low to tell"
    assert limits_after("import mlx_lm", 1024, hard) == (2048, 4096)  # mlx-lm's own call, as it is
    blas = "from app.engine.blas import load_fast_blas; load_fast_blas()"
    assert limits_after(f"{blas}\nfrom app.open_files import import_mlx_lm; import_mlx_lm()\nimport mlx_lm",
                        1024, hard) == (2048, hard)
    assert limits_after(f"{blas}\nfrom app.open_files import import_mlx_lm; import_mlx_lm()", 8000, hard) == \
        (8000, hard)


def serve(home: Path, soft: int, hard: int, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SEMANTIC_HOME": str(home), "SEMANTIC_PORT": str(free_port())}
    env.pop("SEMANTIC_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "app", "serve", "--no-worker", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limited(soft, hard))


def may_raise_hard_limit() -> bool:
    """Whether this process may raise its hard limit (CAP_SYS_RESOURCE), asked of a child."""
    code = ("import resource; s, h = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "try: resource.setrlimit(resource.RLIMIT_NOFILE, (s, h + 1))\nexcept (OSError, ValueError): exit(1)")
    return subprocess.run([sys.executable, "-c", code], preexec_fn=limited(1024, 3000)).returncode == 0


def test_serve_refuses_limits_the_process_cannot_open_files_for(tmp_path: Path) -> None:
    # A model that is not installed: a start that passes the limits' check stops at the model.
    done = serve(tmp_path, 1024, 3000, "--model", "no-such-model", "--max-connections", "2600",
                 "--max-websockets", "100")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    if may_raise_hard_limit():  # a privileged process raises its hard limit too
        assert "no-such-model" in errors[0], done.stderr
    else:
        assert errors == ["semantic: error: max_connections 2600 and max_websockets 100 need up to 3512 open "
                          "files: the open-files limit is 1024 (hard 3000) and cannot be raised to 3512: not "
                          "allowed to raise maximum limit; raise `ulimit -n` or lower them"], done.stderr
