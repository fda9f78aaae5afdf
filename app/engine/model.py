"""Load a model directory with mlx-lm, in the compute dtype this backend wants."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper

from app.errors import InvalidModelFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model and its tokenizer, ready for the engine thread."""

    name: str
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    context_length: int
    dtype: str
    stop_token_ids: frozenset[int]


def backend_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu:
        return "metal" if mx.metal.is_available() else "cuda"
    return "cpu"


def _compute_dtype(requested: str) -> Any:
    if requested == "auto":
        return mx.float32 if backend_name() == "cpu" else None
    try:
        return getattr(mx, requested)
    except AttributeError:
        raise InvalidModelFile(f"unknown dtype {requested!r}") from None


def load_model(name: str, path: Path, dtype: str = "auto") -> LoadedModel:
    """Load ``path`` (an mlx-lm model directory).

    On the CPU backend weights are cast to float32: bf16/fp16 matmuls do not go
    through BLAS there and are an order of magnitude slower.

    Raises:
        InvalidModelFile: the directory is missing or not loadable.
    """
    if not (path / "config.json").exists():
        raise InvalidModelFile(f"{path}: not a model directory (no config.json)")
    model, tokenizer = mlx_load(str(path))
    target = _compute_dtype(dtype)
    if target is not None:
        model.set_dtype(target)
    mx.eval(model.parameters())
    config = json.loads((path / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or tokenizer.model_max_length or 4096)
    eos = config.get("eos_token_id", [])
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | set(tokenizer.eos_token_ids)
    used = str(target or "model's own").removeprefix("mlx.core.")
    log.info("loaded model %s from %s (context %d, dtype %s)", name, path, context, used)
    return LoadedModel(name, path, model, tokenizer, context, used, frozenset(stop_ids))
