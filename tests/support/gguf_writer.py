"""Tiny random models of each GGUF family, written as llama.cpp's converter writes them
(``convert_hf_to_gguf.py``), for the importer's tests: metadata through ``gguf.GGUFWriter``'s
own calls (``add_block_count``, ``add_expert_count``, ...), tensor names from gguf's
``TensorNameMap`` forward (the direction the converter uses), and the converter's value
conventions applied: the llama family's q/k rows permuted, Gemma's norms stored as ``1 + w``.
Weights are float32 (F32 tensors), so an import gives mlx-lm's model back exactly.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from mlx.utils import tree_flatten

from app.catalog.gguf_import import GgufFile, GgufVocab
from support.families import BASE, build

V = dict(BASE, vocab_size=49152, rope_theta=10000.0)  # SmolLM2's tokenizer: its vocabulary is written
DENSE = dict(num_hidden_layers=2, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)

def family(**config: Any) -> dict[str, Any]:
    return {**V, **DENSE, **config}


# GGUF architecture -> the mlx-lm config of a tiny model of it, with the values GGUF carries
# (what it does not, llama.cpp's fixed ones: Gemma's query scale, gpt-oss's alternating layers).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": family(model_type="llama", tie_word_embeddings=False),
    "qwen2": family(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": family(model_type="qwen3", head_dim=16, rope_theta=1e6, tie_word_embeddings=True),
    "qwen2moe": family(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
                     shared_expert_intermediate_size=32, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3moe": family(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True,
                     rope_theta=1e6, tie_word_embeddings=True),
    "gemma2": family(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": family(model_type="gemma3_text", num_hidden_layers=6, num_key_value_heads=1, head_dim=16,
                   sliding_window=48, sliding_window_pattern=6, query_pre_attn_scalar=16,
                   rope_local_base_freq=10000.0, rope_theta=1e6),
    "phi3": family(model_type="phi3", partial_rotary_factor=0.5, tie_word_embeddings=False),
    "gpt-oss": family(model_type="gpt_oss", intermediate_size=32, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=48, layer_types=["sliding_attention", "full_attention"],
                    rope_theta=150000.0),
    "granite": family(model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.0625,
                    residual_multiplier=0.22, logits_scaling=8.0, attention_bias=False, mlp_bias=False,
                    tie_word_embeddings=True),
    "olmo2": family(model_type="olmo2", rope_theta=500000.0, tie_word_embeddings=False),
    "starcoder2": family(model_type="starcoder2", norm_epsilon=1e-5, rope_theta=100000.0,
                       tie_word_embeddings=True),
}
PERMUTED_QK = ("llama", "granite")  # llama.cpp's LlamaModel.permute
ONE_PLUS_NORMS = ("gemma2", "gemma3")  # llama.cpp: data_torch + 1 for norm weights


def _metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    if arch == "starcoder2":
        writer.add_layer_norm_eps(config["norm_epsilon"])
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if "head_dim" in config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "granite":
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])


@cache
def _vocab(smollm2_gguf: Path) -> GgufVocab:
    """SmolLM2's vocabulary, read once (gguf's reader takes ~3.6 s over its 49K tokens and merges)."""
    return GgufFile(smollm2_gguf).vocab()


def _tokenizer(writer: gguf.GGUFWriter, smollm2_gguf: Path) -> None:
    vocab = _vocab(smollm2_gguf)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges or [])
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rotate-half -> interleaved rows)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for Llama 3's RoPE scaling (LlamaModel.generate_extra_tensors)."""
    scaling = config["rope_scaling"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write(arch: str, out: Path, smollm2_gguf: Path, seed: int = 7,
          config: dict[str, Any] | None = None) -> tuple[Any, Path]:
    """A tiny random model of ``arch`` (mlx-lm's, evaluated; ``config`` instead of the family's
    own) and the GGUF file of it at ``out``."""
    config = config or FAMILIES[arch]
    model = build(config, seed)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config["num_hidden_layers"])
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny {arch}")
    _metadata(writer, arch, config)
    _tokenizer(writer, smollm2_gguf)
    for name, value in tree_flatten(model.parameters()):
        hf_name = name.replace(".switch_mlp.", ".experts.")  # the converter names stacked experts so
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, (arch, name)
        data = np.array(value, dtype=np.float32)
        if arch in PERMUTED_QK and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute(data, config["num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"])
        if arch in ONE_PLUS_NORMS and gguf_name.endswith("norm.weight"):
            data = data + 1.0
        writer.add_tensor(gguf_name, data)
    if config.get("rope_scaling", {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, out
