"""What a GGUF file's architecture is in mlx-lm: its config, each tensor's name there, and the
conventions of llama.cpp's converter undone.

Two well-kept mappings do most of it:

* config keys: transformers' GGUF config mapping (``transformers.integrations.ggml``,
  ``GGUF_CONFIG_MAPPING``: ``{arch}.block_count`` -> ``num_hidden_layers`` and the like; it
  needs no torch). A family it lacks reads the keys llama.cpp writes for every
  architecture with its llama entry;
* tensor names: gguf's ``TensorNameMap`` (``gguf.get_tensor_name_map``), the table
  llama.cpp's own converter names tensors with, read in reverse: each parameter of mlx-lm's
  model of the family (built with lazy weights, never computed) is looked up in it, so the
  name written is the one mlx-lm loads, and a parameter that no GGUF tensor provides is an
  error naming it.

What neither knows is in the small tables below, each with a test
(``tests/integration/test_gguf_families.py``):

* ``_MODEL_TYPES``: the mlx-lm model type of an architecture where the names differ;
* ``_MORE_KEYS``: config keys transformers' mapping lacks for a family;
* ``_FIXED``: values llama.cpp hard-codes and GGUF does not store;
* ``_RENAMES``: how mlx-lm names a parameter that TensorNameMap knows by another name
  (stacked experts are ``switch_mlp``, a vision-language wrapper's ``language_model.``);
* the conventions of values: llama.cpp permutes the q/k rows of the llama family for its
  interleaved RoPE (``_PERMUTED_QK``), stores Gemma's RMSNorm weights as ``1 + w``
  (``_ONE_PLUS_NORMS``), and precomputes Llama 3's RoPE scaling as a ``rope_freqs`` tensor.

Tied embeddings (no ``output.weight``), biases (a ``.bias`` tensor beside the weight) and
MoE experts (stacked by llama.cpp as mlx-lm stacks them) need no table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from app.errors import InvalidModelFile

# GGUF architecture -> mlx-lm model type, where they differ.
_MODEL_TYPES = {
    "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
}
# Families whose keys transformers maps under another name than their mlx-lm model type.
_TRANSFORMERS_NAMES = {"gemma3_text": "gemma3"}
# Config keys transformers' mapping lacks, by model type: the GGUF key (after the
# architecture's prefix) -> the config key.
_COMMON_KEYS = {"attention.key_length": "head_dim"}
_MORE_KEYS: dict[str, dict[str, str]] = {
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gpt_oss": {"attention.sliding_window": "sliding_window", "expert_feed_forward_length": "intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "granite": {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"},
    "starcoder2": {"rope.freq_base": "rope_theta"},
}
# mlx-lm's parameter names that TensorNameMap knows by another: (mlx-lm's, TensorNameMap's).
_RENAMES = ((".switch_mlp.", ".experts."), ("language_model.", ""))
_PERMUTED_QK = frozenset({"llama", "granite"})  # llama.cpp's LlamaModel and its subclasses
_ONE_PLUS_NORMS = frozenset({"gemma", "gemma2", "gemma3"})
_SUPPORTED = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3", "gpt-oss",
              "granite", "olmo2", "starcoder2")


def supported() -> tuple[str, ...]:
    """The GGUF architectures the importer knows, each tested."""
    return _SUPPORTED


def model_type(architecture: str) -> str:
    return _MODEL_TYPES.get(architecture, architecture)


def _fixed(model: str, config: dict[str, Any]) -> dict[str, Any]:
    """Values llama.cpp hard-codes for a family, GGUF storing none of them."""
    if model in ("gemma2", "gemma3_text"):
        # llama.cpp scales queries by 1/sqrt(hidden / heads) on the 27B models (46 and 62
        # layers), by 1/sqrt(head_dim) on the others.
        large = config["num_hidden_layers"] in (46, 62)
        scalar = config["hidden_size"] // config["num_attention_heads"] if large else config["head_dim"]
        fixed: dict[str, Any] = {"query_pre_attn_scalar": scalar}
        if model == "gemma3_text":
            fixed |= {"rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}
        return fixed
    if model == "gpt_oss":  # sliding and full attention alternate, the first sliding
        return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(config["num_hidden_layers"])]}
    if model == "qwen3_moe":
        return {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if model == "qwen2_moe":
        return {"decoder_sparse_step": 1, "mlp_only_layers": []}
    return {}


def _key_mapping(model: str) -> dict[str, str | None]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    mappings = cast(dict[str, dict[str, str | None]], GGUF_CONFIG_MAPPING)
    family = mappings.get(_TRANSFORMERS_NAMES.get(model, model)) or mappings["llama"]
    # NOTE: rope.dimension_count is the rotary part of a head (partial on phi3), not head_dim.
    mapping: dict[str, str | None] = {**mappings["llama"], **family, "rope.dimension_count": None}
    return {**mapping, **_COMMON_KEYS, **_MORE_KEYS.get(model, {})}


def config(architecture: str, metadata: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]],
           n_vocab: int) -> dict[str, Any]:
    """The mlx-lm config of a GGUF file: its architecture, its metadata (each key without the
    architecture's prefix: ``block_count``, ``attention.head_count``, ...) and its tensors'
    shapes (as mlx-lm holds them).

    Raises:
        InvalidModelFile: the architecture is not one the importer knows.
    """
    if architecture not in _SUPPORTED:
        raise InvalidModelFile(f"architecture {architecture!r} is not supported (supported: "
                               f"{', '.join(sorted(_SUPPORTED))}; docs/models.md lists every family)")
    model = model_type(architecture)
    out: dict[str, Any] = {"model_type": model}
    for key, name in _key_mapping(model).items():
        if name is not None and key in metadata:
            value = metadata[key]
            out[name] = max(value) if isinstance(value, list) else value  # per-layer lists: llama.cpp's
    out["vocab_size"] = n_vocab
    if "head_dim" not in out:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    rotary = metadata.get("rope.dimension_count")
    if rotary and rotary < out["head_dim"]:
        out["partial_rotary_factor"] = rotary / out["head_dim"]
    out["tie_word_embeddings"] = "output.weight" not in tensors
    out["attention_bias"] = "blk.0.attn_q.bias" in tensors
    out["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    out |= _fixed(model, out)
    scaling = _rope_scaling(metadata)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """Scaling GGUF states in its keys (Llama 3's is a tensor instead: ``llama3_scaling``)."""
    kind = metadata.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise InvalidModelFile(f"RoPE scaling {kind!r} is not supported")
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": metadata["rope.scaling.factor"]}
    if "rope.scaling.original_context_length" in metadata:
        scaling["original_max_position_embeddings"] = metadata["rope.scaling.original_context_length"]
    return scaling


def llama3_scaling(freq_factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3's RoPE scaling from llama.cpp's ``rope_freqs`` (a divisor per frequency): the
    published parameters (low 1, high 4, 8192 original positions, the largest divisor as the
    factor) if they make exactly that tensor.

    Raises:
        InvalidModelFile: the tensor is not one those parameters make.
    """
    factor = float(freq_factors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    dims = config["head_dim"]
    base = float(config.get("rope_theta", 10000.0))
    wavelengths = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    low_wave, high_wave = 8192 / 1.0, 8192 / 4.0
    smooth = np.clip((8192 / wavelengths - 1.0) / (4.0 - 1.0), 0.0, 1.0)
    expected = np.where(wavelengths < high_wave, 1.0,
                        np.where(wavelengths > low_wave, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if expected.shape != freq_factors.shape or not np.allclose(expected, freq_factors, rtol=1e-3):
        raise InvalidModelFile("rope_freqs holds a RoPE scaling other than Llama 3's published one")
    return scaling


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a GGUF tensor goes: mlx-lm's parameter name and shape."""

    name: str
    shape: tuple[int, ...]


def placements(config: dict[str, Any], architecture: str, tensors: Mapping[str, tuple[int, ...]]
               ) -> dict[str, Placed]:
    """Each GGUF tensor's mlx-lm parameter (GGUF name -> ``Placed``): mlx-lm's model of the
    family is built with lazy weights, and each parameter looked up in gguf's TensorNameMap.
    Tensors no parameter takes are left out (``rope_freqs``: read into the config).

    Raises:
        InvalidModelFile: a parameter that no tensor of the file provides, or one of
            another shape.
    """
    import gguf
    from mlx.utils import tree_flatten  # NOTE: the caller loads the BLAS first (app.engine.blas)
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    flat = cast(list[tuple[str, Any]], tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    parameters = {name: tuple(p.shape) for name, p in flat}
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    placed: dict[str, Placed] = {}
    missing = []
    for name, shape in parameters.items():
        source = _gguf_name(names, name)
        if source is None or source not in tensors:
            if name == "lm_head.weight" and config["tie_word_embeddings"]:
                continue
            missing.append(name if source is None else f"{name} ({source})")
            continue
        if tensors[source] != shape and math.prod(tensors[source]) != math.prod(shape):
            raise InvalidModelFile(f"{source} has shape {tensors[source]}; mlx-lm's {config['model_type']} "
                                   f"holds {name} as {shape}")
        placed[source] = Placed(name, shape)
    if missing:
        raise InvalidModelFile(f"{architecture}: no tensor for mlx-lm's {', '.join(missing[:5])}"
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return placed


def _gguf_name(names: Any, parameter: str) -> str | None:
    candidates = [parameter]
    for theirs, ours in _RENAMES:
        candidates += [c.replace(theirs, ours) for c in candidates if theirs in c]
    for candidate in candidates:
        found = names.get_name(candidate, try_suffixes=(".weight", ".bias"))
        if found is not None:
            return str(found)
    return None


def convert(architecture: str, name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A tensor's values as mlx-lm holds them: llama.cpp's conventions undone."""
    if architecture in _PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
        data = _unpermute_rows(data, heads)
    if architecture in _ONE_PLUS_NORMS and name.endswith("norm.weight"):
        data = data - 1.0
    return data


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
