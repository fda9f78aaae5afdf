"""Installed models: directories under ``$SEMANTIC_HOME/models``."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from app.catalog.embedded import EMBEDDED, locate_gguf
from app.catalog.gguf_import import import_gguf
from app.errors import NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstalledModel:
    name: str
    path: Path
    created_at: float
    architecture: str


def model_path(models_dir: Path, name_or_path: str) -> Path:
    """The directory of a model given by name (under ``models_dir``) or by path."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_absolute() or name_or_path.startswith("."):
        return candidate
    return models_dir / name_or_path


def list_models(models_dir: Path) -> list[InstalledModel]:
    models = []
    for config in sorted(models_dir.glob("*/config.json")):
        try:
            arch = json.loads(config.read_text()).get("model_type", "unknown")
        except (OSError, ValueError):
            continue
        models.append(InstalledModel(config.parent.name, config.parent, config.stat().st_mtime, arch))
    return models


def ensure_embedded(models_dir: Path, name: str, *, progress: bool = True) -> Path:
    """Import an embedded model from its PyPI package unless already imported.

    Raises:
        NotFound: ``name`` is not an embedded model, or its package is missing.
    """
    destination = models_dir / name
    if (destination / "config.json").exists():
        return destination
    model = EMBEDDED.get(name)
    if model is None:
        raise NotFound(f"model {name!r} is not installed in {models_dir} and is not embedded")
    scratch = models_dir / ".scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        source = locate_gguf(model, scratch)
        log.info("importing embedded model %s from %s", name, source)
        import_gguf(source, destination, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return destination
