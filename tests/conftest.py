"""Shared fixtures: real models imported from their PyPI packages, a real server."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from app.engine.blas import blas_in_use, load_fast_blas
from app.open_files import import_mlx_lm
from app.settings import load_settings

if TYPE_CHECKING:
    from app.pool.postgres import LocalPostgres

# MLX must bind to OpenBLAS: load it before any test module imports mlx. mlx-lm then may not
# lower the open-files limit that the servers the tests start inherit.
load_fast_blas()
try:
    import_mlx_lm()
except ImportError:  # MLX blocked or absent: the API tier alone (tests/unit/test_api_tier_without_mlx.py)
    pass


def pytest_sessionstart(session: pytest.Session) -> None:
    """On Linux the suite refuses to run on MLX's reference BLAS: every timing and
    timeout in it assumes OpenBLAS (about 70x faster)."""
    if platform.system() == "Linux" and not blas_in_use().startswith("openblas"):
        pytest.exit("OpenBLAS is not loaded (install libopenblas0-pthread; scripts/test does it with apt)",
                    returncode=3)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from support.servers import ServerProcess, free_port, start_server, stop_server  # noqa: E402  (after the path)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """Where imported models live: $SEMANTIC_HOME/models (imports are reused across runs)."""
    return load_settings().models_dir


def _embedded(models_dir: Path, name: str) -> Path:
    """An embedded model, imported and its KV format calibrated once (later loads read the record)."""
    from app.catalog.registry import ensure_embedded
    from app.engine.model import ensure_calibrated

    path = ensure_embedded(models_dir, name, progress=False)
    ensure_calibrated(name, path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(models_dir: Path) -> Path:
    return _embedded(models_dir, "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_dir(models_dir: Path) -> Path:
    return _embedded(models_dir, "gemma3-270m")


@pytest.fixture(scope="session")
def coder05_dir(models_dir: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, real weights (installed by scripts/test, pinned)."""
    return _embedded(models_dir, "qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def coder15_dir(models_dir: Path) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct, real weights (installed by scripts/test, pinned)."""
    return _embedded(models_dir, "qwen2.5-coder-1.5b")


CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.169.0"


def npm_cli(package: str, binary: str) -> Path:
    """A pinned CLI (``name@version``) installed from the npm registry into the repository's cache once."""
    name, version = package.rsplit("@", 1)
    install_dir = ROOT / ".cache" / f"{name.rsplit('/', 1)[-1]}-{version}"
    path = install_dir / "node_modules" / ".bin" / binary
    if not path.exists():
        npm = shutil.which("npm")
        assert npm, f"npm is required for the {binary} tests (Node.js 18+)"
        subprocess.run([npm, "install", "--prefix", str(install_dir), package], check=True, capture_output=True,
                       timeout=600)
    return path


@pytest.fixture(scope="session")
def postgres() -> Iterator["LocalPostgres"]:
    """A throwaway PostgreSQL cluster for the session (initdb + start: about 1 s)."""
    import tempfile

    from app.pool.postgres import LocalPostgres

    root = Path(tempfile.mkdtemp(prefix="semantic-pg-"))
    root.chmod(0o755)  # as root the cluster belongs to the postgres user, who must reach it
    cluster = LocalPostgres(root / "pg", free_port())
    cluster.start(durable=False)
    yield cluster
    cluster.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)


# The stores the store tests run on: both by default; SEMANTIC_TEST_STORES=sqlite (the
# quick tier, `scripts/test quick`) leaves PostgreSQL out.
TEST_STORES = [name for name in os.environ.get("SEMANTIC_TEST_STORES", "sqlite,postgresql").split(",") if name]
assert TEST_STORES and set(TEST_STORES) <= {"sqlite", "postgresql"}, f"SEMANTIC_TEST_STORES: {TEST_STORES}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without PostgreSQL among the stores, the tests that need its cluster are deselected
    (counted as such in the summary), not run against nothing."""
    if "postgresql" in TEST_STORES:
        return
    needs = [item for item in items if "postgres" in getattr(item, "fixturenames", ())]
    if needs:
        config.hook.pytest_deselected(items=needs)
        items[:] = [item for item in items if item not in needs]


@pytest.fixture(params=TEST_STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database on each store the server supports: a SQLite file, a PostgreSQL
    database of its own (not migrated: tests call ``upgrade``)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'semantic.db'}"
    return request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def claude() -> Path:
    """The real Claude Code CLI."""
    return npm_cli(CLAUDE_CODE, "claude")


@pytest.fixture(scope="session")
def codex() -> Path:
    """The real Codex CLI."""
    return npm_cli(CODEX, "codex")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    """One real server for the session, serving SmolLM2 from a scratch SEMANTIC_HOME."""
    running = start_server(tmp_path_factory.mktemp("server-home"), smollm2_dir)
    yield running
    stop_server(running)
