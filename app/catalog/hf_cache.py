"""Models in the local Hugging Face cache, found offline the way mlx_lm finds them.

A repo id (``org/name``) means the snapshot its ``refs/main`` points at in the hub
cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
located by huggingface_hub with ``local_files_only``: nothing is downloaded and the
cache is only read. What Semantic records about such a model (its weights' digest,
its KV calibration) goes to a *view* in its own home: a directory of links to the
snapshot's files, which mlx-lm loads as it loads the snapshot.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from app.errors import NotFound

# What mlx_lm downloads and loads from a repo (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS in 0.32.2;
# a test keeps them equal). Importing mlx_lm here would load MLX before OpenBLAS.
MLX_FILES = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
             "*.jsonl", "*.jinja")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


@dataclass(frozen=True, slots=True)
class CachedModel:
    """One repo's snapshot in the hub cache."""

    repo_id: str
    commit: str
    snapshot: Path

    @property
    def architecture(self) -> str:
        import json

        try:
            return str(json.loads((self.snapshot / "config.json").read_text()).get("model_type", "unknown"))
        except (OSError, ValueError):
            return "unknown"


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a Hugging Face model id (``org/name``; never a path: no ``..``)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and "--" not in name and not name.endswith(".")


def hub_cache(cache_dir: Path | None = None) -> Path:
    """The hub cache: ``cache_dir``, or where huggingface_hub looks (HF_HUB_CACHE, HF_HOME)."""
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def not_mlx(files: list[str]) -> str | None:
    """Why a repo or snapshot holding ``files`` (paths in it) is not a model mlx-lm loads, or None."""
    weights = any(fnmatch.fnmatch(f, "model*.safetensors") and "/" not in f for f in files)
    if weights and "config.json" in files:
        return None
    gguf = [f for f in files if f.endswith(".gguf")]
    if gguf and not weights:
        return (f"it holds GGUF files ({gguf[0]}, ...), not a model mlx-lm loads: download one and "
                "`semantic models import` it")
    if "config.json" not in files:
        return "it has no config.json"
    return "it has no model*.safetensors weights, so it is not a model mlx-lm loads"


def find(repo_id: str, cache_dir: Path | None = None) -> CachedModel:
    """The snapshot ``refs/main`` of ``repo_id`` points at, offline.

    Raises:
        NotFound: not in the cache (the message names the cache), downloaded only in part,
            or not an MLX model.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hub_cache(cache_dir)
    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache,
                                          allow_patterns=list(MLX_FILES)))
    except IncompleteSnapshotError:
        raise NotFound(f"model {repo_id!r}: its download into {cache} is incomplete; "
                       f"`semantic models pull {repo_id}` finishes it") from None
    except LocalEntryNotFoundError:
        raise NotFound(f"model {repo_id!r} is not in the Hugging Face cache: looked for "
                       f"{repo_folder(repo_id, cache)}/refs/main (the cache is HF_HUB_CACHE, "
                       f"else $HF_HOME/hub); `semantic models pull {repo_id}` downloads it") from None
    problem = not_mlx([p.name for p in snapshot.iterdir()])
    if problem:
        raise NotFound(f"model {repo_id!r} in the Hugging Face cache ({snapshot}): {problem}")
    return CachedModel(repo_id, snapshot.name, snapshot)


def list_cached(cache_dir: Path | None = None) -> list[CachedModel]:
    """The MLX models of the hub cache whose ``refs/main`` is complete, by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(hub_cache(cache_dir)).repos
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or "main" not in repo.refs or not is_repo_id(repo.repo_id):
            continue
        try:
            found.append(find(repo.repo_id, cache_dir))
        except NotFound:
            continue  # not an MLX model, or incomplete
    return found


def view(model: CachedModel, views_dir: Path) -> Path:
    """The directory Semantic loads ``model`` from and writes its records into: under
    ``views_dir``, one per snapshot, holding a link to each of the snapshot's files."""
    target = repo_folder(model.repo_id, views_dir) / model.commit
    target.mkdir(parents=True, exist_ok=True)
    for entry in model.snapshot.iterdir():
        link = target / entry.name
        if not link.is_symlink():
            try:
                link.symlink_to(entry)
            except FileExistsError:
                pass  # made by another process meanwhile
    return target


def repo_folder(repo_id: str, parent: Path) -> Path:
    """The folder of ``repo_id`` under ``parent``, named as the hub cache names it (and the views)."""
    return parent / ("models--" + repo_id.replace("/", "--"))


def delete_from_cache(repo_id: str, cache_dir: Path | None = None) -> int:
    """Delete every revision of ``repo_id`` from the hub cache with huggingface_hub's cache
    API; returns the bytes freed.

    Raises:
        NotFound: the cache holds no such model.
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache(cache_dir))
    except CacheNotFound:
        info = None
    repo = next((r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"), None) if info else None
    if info is None or repo is None:
        raise NotFound(f"model {repo_id!r} is not in the Hugging Face cache {hub_cache(cache_dir)}")
    strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
    strategy.execute()
    return strategy.expected_freed_size
