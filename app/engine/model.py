"""Load a model directory with mlx-lm, in the compute dtype this backend wants."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as load_weights
from mlx_lm.utils import load_tokenizer

from app.cache.blocks import to_working_cache
from app.cache.checkpoints import CacheLayout, unsupported_caches
from app.cache.formats import KV_FORMATS, KVFormat
from app.engine import attention, calibration, cores
from app.engine.backend import device_kind
from app.engine.cores import CoreSplit
from app.engine.kv_choice import CALIBRATION_VERSION, KVChoice
from app.engine.token_text import TokenBytes
from app.engine.tool_syntax import tool_syntax
from app.errors import InvalidModelFile
from app.types import ToolSyntax

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ModelSpec:
    """A model without its weights: what rendering, admission and cache keys need.

    Cheap to build (tokenizer and config), so API threads hold one per model a
    request names while the engine thread has another model loaded.
    """

    name: str
    path: Path
    tokenizer: TokenizerWrapper
    context_length: int
    stop_token_ids: frozenset[int]
    fingerprint: str
    token_bytes: TokenBytes
    kv_bytes_per_token: int  # a float working cache's bytes per token (keys and values, every layer)
    vocab_size: int
    kv: KVChoice  # the stored KV format (part of ``fingerprint``)
    tool_syntax: ToolSyntax | None  # its own tool-call format (None: the generic one)

    @property
    def kv_format(self) -> KVFormat:
        return self.kv.format


@dataclass(frozen=True)
class LoadedModel(ModelSpec):
    """A model and its tokenizer, ready for the engine thread."""

    model: nn.Module
    dtype: str
    cores: CoreSplit | None = None  # batched decode steps split over both CPU cores
    layout: CacheLayout | None = None  # what each layer's cache holds (None: attention KV in every layer)

    @property
    def cache_layout(self) -> CacheLayout:
        return self.layout if self.layout is not None else CacheLayout.attention_only(len(self.model.layers))

    @property
    def n_layers(self) -> int:
        """Layers whose attention keys and values the cache blocks hold."""
        return self.cache_layout.n_attention

    @property
    def compute_dtype(self) -> mx.Dtype:
        return _param_dtype(self.model)


def _param_dtype(model: nn.Module) -> mx.Dtype:
    arrays: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return next(v.dtype for _, v in arrays if mx.issubdtype(v.dtype, mx.floating))


def model_fingerprint(path: Path, kv_format: str) -> str:
    """sha256 over the weights, tokenizer, chat template and KV format."""
    weights = sorted(path.glob("*.safetensors"))
    final = hashlib.sha256((_linked_weights_digest(weights) or _hashed_weights_digest(path, weights)).encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (path / name).exists():
            final.update(name.encode() + (path / name).read_bytes())
    final.update(kv_format.encode())
    return final.hexdigest()


def _hashed_weights_digest(path: Path, weights: list[Path]) -> str:
    """sha256 over the weights' bytes. It takes a second per few hundred MB, so it is
    memoised in ``.fingerprint.json`` keyed by file sizes and times."""
    stamp = [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights]
    memo_path = path / ".fingerprint.json"
    try:
        memo = json.loads(memo_path.read_text())
        if memo.get("stamp") == stamp:
            return str(memo["weights_sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    for weight in weights:
        with weight.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    try:
        memo_path.write_text(json.dumps({"stamp": stamp, "weights_sha256": digest.hexdigest()}))
    except OSError:
        log.warning("cannot write %s; the model will be hashed again next start", memo_path)
    return digest.hexdigest()


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _linked_weights_digest(weights: list[Path]) -> str | None:
    """A digest of the weights read from their names alone, when every weights file is a
    link into a ``blobs`` directory naming files by their sha256 (the Hugging Face cache
    stores a Git LFS file, as safetensors weights are, under its sha256); else None."""
    names = []
    for weight in weights:
        target = weight.resolve()
        if not weight.is_symlink() or target.parent.name != "blobs" or not _SHA256.fullmatch(target.name):
            return None
        names.append(f"{weight.name}:{target.name}")
    return hashlib.sha256(" ".join(names).encode()).hexdigest() if names else None


def config_head_dim(config: dict[str, Any]) -> int:
    """Values per attention head: ``head_dim``, else hidden_size / heads (0: the config says neither)."""
    heads = int(config.get("num_attention_heads", 1))
    return int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """Keys and values of one token in every layer, at ``dtype_bytes`` a value."""
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config.get("num_hidden_layers", 0)) * 2 * kv_heads * config_head_dim(config) * dtype_bytes


def backend_name() -> str:
    return device_kind()


def compute_dtype(requested: str) -> Any:
    if requested == "auto":
        return mx.float32 if backend_name() == "cpu" else None
    try:
        return getattr(mx, requested)
    except AttributeError:
        raise InvalidModelFile(f"unknown dtype {requested!r}") from None


def run_dtype(config: dict[str, Any], requested: str) -> Any:
    """The dtype a model of ``config`` computes (and caches) in: ``requested``'s, else its weights'."""
    return compute_dtype(requested) or getattr(mx, str(config.get("torch_dtype") or "bfloat16"), mx.bfloat16)


def calibration_key(path: Path) -> str:
    """What a model's KV calibration is valid for: its weights, tokenizer and template, and the calibration version."""
    return model_fingerprint(path, f"kv-calibration-v{CALIBRATION_VERSION}")


def _head_dim(path: Path) -> int:
    """The head_dim the config of the model at ``path`` states (0: none, or no config)."""
    try:
        return config_head_dim(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return 0


def fitted_format(path: Path, name: str) -> KVFormat:
    """The stored format ``name`` for the heads of the model at ``path`` (``KVFormat.for_head_dim``;
    a config that states no head_dim: as it is, and ``load_model`` checks the heads it caches).

    Raises:
        InvalidModelFile: the format cannot store this model's heads (one line: why, not naming the model).
    """
    head_dim = _head_dim(path)
    if not head_dim:
        return KV_FORMATS[name]
    try:
        return KV_FORMATS[name].for_head_dim(head_dim)
    except ValueError as exc:
        raise InvalidModelFile(str(exc)) from None


def kv_choice(path: Path, kv_format: str) -> KVChoice:
    """The stored format ``kv_format`` (a format's name, or "auto") means for the model at
    ``path``, without measuring: "auto" is the recorded calibration's choice, or pending.

    Raises:
        InvalidModelFile: a pinned format cannot store this model's heads.
    """
    if kv_format != "auto":
        return KVChoice(fitted_format(path, kv_format), "setting", calibration.read_record(path, calibration_key(path)))
    record = calibration.read_record(path, calibration_key(path))
    if record is None:
        return KVChoice(KV_FORMATS[calibration.LOSSLESS], "pending")
    return KVChoice(fitted_format(path, record.chosen), "calibration", record)


def candidate_formats(path: Path, head_dims: set[int], name: str | None = None) -> list[KVFormat]:
    """The formats ``auto`` measures for the model at ``path``, which caches keys and values
    of ``head_dims`` values: those that can store them (each one that cannot is logged, with why,
    under the model's ``name``)."""
    model_name = name or path.name
    candidates = []
    for name in KV_FORMATS:
        try:
            fitted = fitted_format(path, name)
            _refuse_unstorable(head_dims, fitted)
            candidates.append(fitted)
        except InvalidModelFile as exc:
            log.info("KV calibration of %s skips %s: %s", model_name, name, exc)
    return candidates


def calibrate(model: nn.Module, tokenizer: TokenizerWrapper, path: Path, head_dims: set[int],
              progress: calibration.Progress | None = None, name: str | None = None) -> KVChoice:
    """Calibrate the model at ``path`` (loaded as ``model``, caching keys and values of
    ``head_dims`` values) among the formats that store them, and record the result with it.
    Its log lines name the model ``name`` (a Hugging Face view's directory is a commit hash)."""
    name = name or path.name
    candidates = candidate_formats(path, head_dims, name)
    log.info("calibrating the KV format of %s (%d formats at most)", name, len(candidates))
    record = calibration.calibrate(model, tokenizer, calibration_key(path), candidates,
                                   progress or (lambda step: log.info("KV calibration of %s: %s done", name, step)))
    calibration.write_record(path, record)
    log.info("KV format of %s: %s (%s), calibrated in %.0f s", name, record.chosen,
             record.measured[record.chosen].describe(), record.seconds)
    return KVChoice(fitted_format(path, record.chosen), "calibration", record)


def cached_head_dims(model: nn.Module) -> set[int]:
    """The widths of the keys and values ``model`` caches (a 4-token prefill): the config's
    head_dim, except in architectures whose keys and values differ from it. The prefill is
    also the model's warm-up (its first forward pass sets up the kernels a prefill chunk
    uses), so a first request does not pay for that and a start runs one pass, not two."""
    layout = CacheLayout.of(model)
    cache = _empty_cache(model, layout)
    mx.eval(model(mx.array([[0, 1, 2, 3]]), cache=cache))
    return {a.shape[-1] for layer in layout.attention(cache) for a in (layer.keys, layer.values)}


def _empty_cache(model: nn.Module, layout: CacheLayout) -> list[Any]:
    """A fresh cache of ``model``'s layout, holding no tokens."""
    return layout.assemble(to_working_cache([], layout.n_attention, 0, _param_dtype(model)), None)


def warm_up(model: nn.Module, chunks: tuple[int, ...]) -> float:
    """Forward passes of ``chunks`` tokens, one after another on one throwaway cache (the
    kernels a prefill, a turn's few new tokens and a decode step use, compiled now: see
    ``backend.warmup_chunks``); returns the seconds they took."""
    start = time.perf_counter()
    cache = _empty_cache(model, CacheLayout.of(model))
    for n in chunks:
        mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache=cache))
    del cache
    mx.clear_cache()
    return time.perf_counter() - start


def _refuse_unstorable(head_dims: set[int], kv_format: KVFormat) -> None:
    """Raise InvalidModelFile (one line: why) unless ``kv_format`` stores keys and values of
    every width in ``head_dims``: a model that loads never answers every turn from a cache
    it cannot store."""
    for head_dim in sorted(head_dims):
        reason = kv_format.unfit_reason(head_dim)
        if reason is not None:
            raise InvalidModelFile(reason)


def ensure_calibrated(name: str, path: Path, dtype: str = "auto",
                      progress: calibration.Progress | None = None) -> KVChoice:
    """The ``auto`` format of the model at ``path``: recorded, or measured now (loading the model)."""
    kv = kv_choice(path, "auto")
    return load_model(name, path, dtype, "auto", progress=progress).kv if kv.chosen_by == "pending" else kv


def load_spec(name: str, path: Path, dtype: str = "auto", kv_format: str = "auto") -> ModelSpec:
    """Tokenizer, context and fingerprint of the model directory ``path``, without its weights.
    ``kv_format``: a stored format's name, or "auto" (see ``kv_choice``).

    Raises:
        InvalidModelFile: the directory is missing or not loadable, or a pinned ``kv_format``
            cannot store its heads.
    """
    if not (path / "config.json").exists():
        raise InvalidModelFile(f"{path}: not a model directory (no config.json)")
    config = json.loads((path / "config.json").read_text())
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError) as exc:
        raise InvalidModelFile(f"{path}: cannot load its tokenizer: {exc}") from exc
    context = int(config.get("max_position_embeddings") or tokenizer.model_max_length or 4096)
    eos = config.get("eos_token_id", [])
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | set(tokenizer.eos_token_ids)
    target = run_dtype(config, dtype)
    try:
        kv = kv_choice(path, kv_format)
    except InvalidModelFile as exc:
        raise InvalidModelFile(f"{name}: {exc}") from None
    # The token bytes from the tokenizer just loaded (a fast one's), not from its file read again.
    backend = getattr(tokenizer._tokenizer, "backend_tokenizer", None)
    token_bytes = TokenBytes.from_tokenizer(backend, str(path / "tokenizer.json")) if backend is not None \
        else TokenBytes.from_tokenizer_json(path / "tokenizer.json")
    return ModelSpec(name, path, tokenizer, context, frozenset(stop_ids),
                     model_fingerprint(path, kv.format.fingerprint), token_bytes,
                     kv_bytes_per_token(config, target.size),
                     int(config.get("vocab_size") or len(tokenizer.vocab)), kv, tool_syntax(tokenizer))


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def load_model(name: str, path: Path, dtype: str = "auto", kv_format: str = "auto",
               split_cores: bool = False, progress: calibration.Progress | None = None,
               warmup: tuple[int, ...] = (), calibrate_pending: bool = True) -> LoadedModel:
    """Load ``path`` (an mlx-lm model directory).

    On the CPU backend weights are cast to float32: bf16/fp16 matmuls do not go
    through BLAS there and are an order of magnitude slower. With ``split_cores``,
    batched decode steps split their work over both CPU cores (``cores``).
    ``kv_format`` "auto" on a model not calibrated yet calibrates it first (``calibrate``;
    ``progress`` is called once per step), unless ``calibrate_pending`` is False: then it
    serves the lossless format (``calibration.LOSSLESS``) until a calibration is recorded.
    ``warmup``: forward passes to run before it serves (``warm_up``; ``backend.warmup_chunks``
    chooses them per device).

    Raises:
        InvalidModelFile: the directory is missing or not loadable, or the KV format
            cannot store the keys and values it caches (``KVFormat.unfit_reason``).
    """
    started = time.perf_counter()
    # The tokenizer and fingerprint (Python, holding the GIL) are read on a thread of their own
    # while this one reads the weights (MLX, without it): a start waits for the longer, not both.
    with ThreadPoolExecutor(1, thread_name_prefix="semantic-spec") as pool:
        pending = pool.submit(_timed, load_spec, name, path, dtype, kv_format)
        try:
            model, config = load_weights(path)
            target = compute_dtype(dtype)
            if target is not None:
                model.set_dtype(target)
            mx.eval(model.parameters())
        except Exception:
            pending.result()  # a directory that is no model: load_spec's InvalidModelFile says so
            raise
        weights_s = time.perf_counter() - started
        spec, spec_s = pending.result()
    unsupported = unsupported_caches(model)
    if unsupported:
        raise InvalidModelFile(f"{name} ({config.get('model_type')}): its layers keep {', '.join(unsupported)} state; "
                               "Semantic's caches hold attention keys and values and, beside them (in other "
                               "layers or in the same one's CacheList), recurrent state (ArraysCache) as "
                               "checkpoints")
    used = _param_dtype(model)
    log.info("loaded model %s from %s (context %d, dtype %s, tool calls: %s) in %.1f s (tokenizer and fingerprint "
             "%.1f s, weights %.1f s, side by side)", name, path, spec.context_length, used,
             f"its own format ({spec.tool_syntax.parser})" if spec.tool_syntax else "the generic format",
             time.perf_counter() - started, spec_s, weights_s)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    fields["kv_bytes_per_token"] = kv_bytes_per_token(config, used.size)
    if used == mx.float32:
        attention.install(model)
    head_dims, first_pass_s = _timed(cached_head_dims, model)
    log.info("first forward pass (4 tokens: the widths the cache stores; it sets up the kernels) in %.1f s",
             first_pass_s)
    if warmup:
        log.info("warmed up for the first requests (its kernels compiled or found compiled): forward passes of "
                 "%s tokens in %.1f s", ", ".join(map(str, warmup)), warm_up(model, warmup))
    if spec.kv.chosen_by == "pending" and calibrate_pending:
        fields["kv"] = calibrate(model, spec.tokenizer, path, head_dims, progress, name)
        fields["fingerprint"] = model_fingerprint(path, fields["kv"].format.fingerprint)
    elif spec.kv.chosen_by == "pending":
        log.warning("KV format of %s: %s (lossless) until its calibration is recorded: `semantic models calibrate "
                    "%s` measures the smallest format that keeps its answers (minutes for a 1B-class model on a "
                    "CPU); the next start uses it", name, spec.kv.format.name, name)
    try:
        _refuse_unstorable(head_dims, fields["kv"].format)
    except InvalidModelFile as exc:
        raise InvalidModelFile(f"{name}: {exc}") from None
    split = cores.install(model) if split_cores and used == mx.float32 else None
    return LoadedModel(**fields, model=model, dtype=str(used).removeprefix("mlx.core."), cores=split,
                       layout=CacheLayout.of(model))
