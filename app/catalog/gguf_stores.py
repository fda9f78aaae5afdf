"""The GGUF files other local model applications keep: Ollama's store and LM Studio's. Pure.

* Ollama: ``$OLLAMA_MODELS``, else ``~/.ollama/models``. A model is a manifest at
  ``manifests/<registry>/<namespace>/<model>/<tag>`` (JSON) whose layer of media type
  ``application/vnd.ollama.image.model`` names its GGUF file by digest, stored at
  ``blobs/sha256-<hex>``. Named as Ollama names it: ``ollama:qwen2.5-coder:1.5b`` (the library
  namespace), ``ollama:user/model:tag``, ``ollama:host/user/model:tag``; no tag is ``latest``.
* LM Studio: ``$LMSTUDIO_MODELS``, else ``~/.lmstudio/models`` (and the older
  ``~/.cache/lm-studio/models``): ``<publisher>/<repository>/<file>.gguf``. Named
  ``lmstudio:<publisher>/<repository>/<file>`` (without ``.gguf``); a repository holding one
  model file may leave the file out. Split files (``-00001-of-00003.gguf``) and vision
  projectors (``mmproj-*``) are not models to import, and are left out.

Either is imported (``gguf_import``) into the home under ``import_name``; the file itself is
only read.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from app.errors import NotFound

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
MODEL_LAYER = "application/vnd.ollama.image.model"
LIBRARY = ("registry.ollama.ai", "library")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True, slots=True)
class StoredGguf:
    """A GGUF file in another application's store."""

    name: str  # as ``--model`` and ``models import`` take it: ``ollama:qwen2.5-coder:1.5b``
    path: Path
    source: str  # which store, for ``models list``


def is_store_name(name: str) -> bool:
    return name.startswith((OLLAMA, LMSTUDIO))


def import_name(name: str) -> str:
    """The model name a stored file is imported under: ``ollama:qwen2.5-coder:1.5b`` ->
    ``ollama-qwen2.5-coder-1.5b``, ``ollama:model`` -> ``ollama-model-latest`` (letters, digits
    and ``._-``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", _tagged(name)).strip("-.")


def _tagged(name: str) -> str:
    """An Ollama name with its tag (``latest`` when it has none); other names as they are."""
    if name.startswith(OLLAMA) and ":" not in name[len(OLLAMA):].rsplit("/", 1)[-1]:
        return f"{name}:latest"
    return name


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def lmstudio_roots() -> list[Path]:
    if os.environ.get("LMSTUDIO_MODELS"):
        return [Path(os.environ["LMSTUDIO_MODELS"])]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def _ollama_name(parts: tuple[str, ...]) -> str:
    """Ollama's own short name of ``registry/namespace/model/tag``."""
    registry, namespace, model, tag = parts
    if (registry, namespace) == LIBRARY:
        return f"{OLLAMA}{model}:{tag}"
    if registry == LIBRARY[0]:
        return f"{OLLAMA}{namespace}/{model}:{tag}"
    return f"{OLLAMA}{registry}/{namespace}/{model}:{tag}"


def ollama_models(root: Path | None = None) -> list[StoredGguf]:
    """The models of Ollama's store whose GGUF blob is there (unreadable manifests left out)."""
    root = root or ollama_root()
    manifests = root / "manifests"
    found = []
    for manifest in sorted(manifests.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text()).get("layers") or []
            digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
        except (OSError, ValueError, AttributeError, KeyError, StopIteration, TypeError):
            continue
        blob = root / "blobs" / str(digest).replace(":", "-")
        if blob.is_file() and re.fullmatch(r"sha256-[0-9a-f]{64}", blob.name):
            name = _ollama_name(manifest.relative_to(manifests).parts)  # type: ignore[arg-type]
            found.append(StoredGguf(name, blob, f"Ollama store ({root})"))
    return found


def lmstudio_models(roots: list[Path] | None = None) -> list[StoredGguf]:
    """The model files of LM Studio's store (split files and vision projectors left out)."""
    found = []
    for root in roots or lmstudio_roots():
        for path in sorted(root.glob("*/*/*.gguf")):
            if _SPLIT.search(path.name) or path.name.lower().startswith("mmproj"):
                continue
            publisher, repository = path.parent.parent.name, path.parent.name
            found.append(StoredGguf(f"{LMSTUDIO}{publisher}/{repository}/{path.stem}", path,
                                    f"LM Studio store ({root})"))
    return found


def stored_models() -> list[StoredGguf]:
    return [*ollama_models(), *lmstudio_models()]


def find(name: str) -> StoredGguf:
    """The stored file ``name`` (``ollama:model[:tag]``, ``lmstudio:publisher/repository[/file]``).

    Raises:
        NotFound: no such model in the store (the message names the store and what it holds).
    """
    if name.startswith(OLLAMA):
        wanted = _tagged(name)
        models = ollama_models()
        match = [m for m in models if m.name == wanted]
        where = f"Ollama's store {ollama_root()}"
    elif name.startswith(LMSTUDIO):
        models = lmstudio_models()
        match = [m for m in models if m.name == name]
        if not match:  # a repository with one model file
            inside = [m for m in models if m.name.rsplit("/", 1)[0] == name]
            match = inside if len(inside) == 1 else []
        where = f"LM Studio's store ({', '.join(map(str, lmstudio_roots()))})"
    else:
        raise NotFound(f"{name!r} names no store: ollama:MODEL[:TAG] or lmstudio:PUBLISHER/REPOSITORY[/FILE]")
    if not match:
        held = ", ".join(m.name for m in models) or "nothing"
        raise NotFound(f"{name!r} is not in {where}; it holds {held}")
    return match[0]
