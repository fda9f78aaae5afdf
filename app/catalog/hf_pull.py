"""``semantic models pull``: an MLX model from the Hugging Face Hub into the hub cache.

The download is huggingface_hub's ``snapshot_download`` (its progress bars, its
resumable ``.incomplete`` files, the endpoint of ``HF_ENDPOINT`` and the token of
``HF_TOKEN``), of the files mlx_lm itself would fetch. A download that stops half way
leaves the snapshot incomplete, which ``hf_cache.find`` refuses to serve; pulling
again resumes it.
"""

from __future__ import annotations

from pathlib import Path

from app.catalog.hf_cache import MLX_FILES, CachedModel, find, hub_cache, is_repo_id, not_mlx
from app.errors import ConfigError, DownloadFailed, NotFound


def pull(repo_id: str, cache_dir: Path | None = None) -> CachedModel:
    """Download ``repo_id`` (its main branch) into the hub cache, with progress bars on stderr.

    Raises:
        ConfigError: not a repo id, or HF_HUB_OFFLINE is set.
        NotFound: no such repo (or private and no token), or not an MLX model.
        DownloadFailed: the Hub could not be reached or the download stopped.
    """
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import logging as hf_logging

    if not is_repo_id(repo_id):
        raise ConfigError(f"{repo_id!r} is not a Hugging Face model id (org/name)")
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("HF_HUB_OFFLINE is set: unset it to download")
    endpoint = constants.ENDPOINT
    hf_logging.disable_propagation()  # its warnings (a resumed download) have a handler of their own
    try:
        info = HfApi().model_info(repo_id, revision="main")
        problem = not_mlx([s.rfilename for s in info.siblings]) if info.siblings is not None else None
        if problem:
            raise NotFound(f"{repo_id} on {endpoint}: {problem}")
        snapshot_download(repo_id, cache_dir=hub_cache(cache_dir), allow_patterns=list(MLX_FILES))
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise NotFound(f"{repo_id}: no such model on {endpoint}, or it is private or gated and HF_TOKEN "
                       f"does not give access ({type(exc).__name__})") from None
    except (OSError, httpx2.HTTPError) as exc:  # the Hub unreachable or failing, a full disk
        raise DownloadFailed(f"downloading {repo_id} from {endpoint} failed: {_reason(exc)}") from exc
    return find(repo_id, cache_dir)


def _reason(exc: BaseException) -> str:
    """The first line of ``exc`` and of its causes, innermost last (what the user can act on)."""
    parts: list[str] = []
    while exc is not None and len(parts) < 3:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        parts.append(text)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return ": ".join(dict.fromkeys(parts))
