"""Installed models (directories under ``$SEMANTIC_HOME/models``), and which of them a
request's ``model`` names (``Catalog``)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from app.catalog.embedded import EMBEDDED, locate_gguf
from app.catalog.gguf_import import import_gguf
from app.errors import ConfigError, NotFound

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


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def model_destination(models_dir: Path, name: str) -> Path:
    """The directory a model called ``name`` is imported into: always inside ``models_dir``.

    Raises:
        ConfigError: ``name`` is not a model name (letters, digits and ``._-``, starting
            with a letter or digit), e.g. ``..`` or a path.
    """
    if not _NAME.fullmatch(name) or len(name) > 128:
        raise ConfigError(f"model name {name!r}: use letters, digits and ._- (starting with a letter or digit)")
    return models_dir / name
_install_lock = threading.Lock()  # one import of an embedded model at a time


def _installed(path: Path) -> bool:
    return (path / "config.json").exists()


@dataclass(frozen=True)
class Catalog:
    """Which model directory a request's ``model`` means.

    A name resolves, in order, as: empty or "default" -> the default model; an alias ->
    its target; the default's or an alias target's own name; with ``any_installed``, a
    model installed under ``models_dir``. Anything else is the default model when
    ``map_unknown`` (Claude Code asks for "claude-sonnet-...") and a 404 otherwise.
    Requests name models, never paths: only the configuration may point at a directory
    outside ``models_dir``, and only the configuration imports an embedded model. Each
    swap reloads the model and sends every conversation's cache to disk, so by default a
    client can choose only among the models the operator configured.
    """

    models_dir: Path
    default: str  # the default model's name
    paths: Mapping[str, Path]  # models the configuration names: the default and alias targets
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> model name
    map_unknown: bool = True
    any_installed: bool = False  # requests may name any installed model (settings.serve_installed_models)

    @classmethod
    def configure(cls, models_dir: Path, default: str, aliases: Mapping[str, str] | None = None,
                  map_unknown: bool = True, any_installed: bool = False) -> Catalog:
        """From the settings: ``default`` and each alias target is a name or a directory.

        Raises:
            ConfigError: a model that is neither installed nor embedded, or an alias that
                shadows an installed model's name.
        """
        paths: dict[str, Path] = {}
        names: dict[str, str] = {}
        for given in (default, *(aliases or {}).values()):
            path = model_path(models_dir, given)
            if not _installed(path) and given not in EMBEDDED:
                raise ConfigError(f"model {given!r} is not installed in {models_dir} and is not embedded "
                                  "(semantic models list)")
            names[given] = path.name
            paths[path.name] = path
        for alias in aliases or {}:
            if alias in paths or _installed(models_dir / alias):
                raise ConfigError(f"model_aliases: {alias!r} is already a model's name")
        return cls(models_dir, names[default], paths, {a: names[t] for a, t in (aliases or {}).items()},
                   map_unknown, any_installed)

    @classmethod
    def single(cls, name: str, path: Path) -> Catalog:
        """One model, served whatever a request names (tests and benchmarks)."""
        return cls(path.parent, name, {name: path})

    def resolve(self, requested: str | None) -> str:
        """The name of the model ``requested`` means.

        Raises:
            NotFound: no such model, and unknown names are not mapped to the default.
        """
        if not requested or requested == "default":
            return self.default
        if requested in self.aliases:
            return self.aliases[requested]
        if requested in self.paths:
            return requested
        if self.any_installed and _NAME.fullmatch(requested) and _installed(self.models_dir / requested):
            return requested
        if self.map_unknown:
            return self.default
        raise NotFound(f"model: {requested!r} is not a model this server serves (serving {self.default!r} "
                       "by default; GET /v1/models lists them)")

    def servable(self, name: str) -> bool:
        """Whether a request may name installed model ``name`` (listed by ``/v1/models``)."""
        return name in self.paths or self.any_installed

    def path(self, name: str) -> Path:
        return self.paths.get(name) or self.models_dir / name

    def install(self, name: str) -> Path:
        """The directory of model ``name``, importing an embedded model on first use.

        Raises:
            NotFound: not installed and its package is missing.
        """
        path = self.path(name)
        if _installed(path):
            return path
        with _install_lock:
            return ensure_embedded(self.models_dir, name)
