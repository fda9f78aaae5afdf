"""Tiny random-weight models of each architecture family the engine is tested on, built
from mlx-lm's own model classes (small shapes of the kind mlx-lm's tests/test_models.py
uses) and saved with the embedded SmolLM2 tokenizer, so the whole engine serves them.

``ATTENTION`` families keep attention keys and values in every layer; ``HYBRID`` ones keep
recurrent state (``ArraysCache``) in some layers, which the cache keeps as checkpoints
(falcon_h1 keeps both in every layer, a ``CacheList``); ``RECURRENT`` ones keep state only
and are refused at load.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

VOCAB = 49152  # SmolLM2's tokenizer
SLOW_DECAY_LOG = -6.0  # A_log of every recurrent head (mamba2 and gated delta net layers)
BASE = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=8192, rms_norm_eps=1e-5)

ATTENTION: dict[str, dict[str, Any]] = {
    "llama": dict(BASE, model_type="llama", num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=1e6, tie_word_embeddings=True),
    "gemma3": dict(BASE, model_type="gemma3_text", num_hidden_layers=3, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=16, sliding_window=48, sliding_window_pattern=3,
                   query_pre_attn_scalar=16),
    "gpt_oss": dict(BASE, model_type="gpt_oss", num_hidden_layers=2, intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=48, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_hidden_layers=2, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
                      norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=True),
    "deepseek_v3": dict(BASE, model_type="deepseek_v3", num_hidden_layers=2, intermediate_size=64,
                        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                        moe_layer_freq=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=16, routed_scaling_factor=1.0, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True, rope_theta=1e4),
}

HYBRID: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(BASE, model_type="qwen3_next", num_hidden_layers=4, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
                       rope_theta=1e6, partial_rotary_factor=0.25, full_attention_interval=2,
                       tie_word_embeddings=False, norm_topk_prob=True),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        BASE, model_type="qwen3_5_text", num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        tie_word_embeddings=True, rope_parameters=dict(rope_theta=1e6, partial_rotary_factor=0.25,
                                                       rope_type="default"))),
    "lfm2": dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=8192, model_type="lfm2",
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5, conv_bias=False,
                 conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, intermediate_size=64,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "nemotron_h": dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=8192, model_type="nemotron_h",
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M"],
                       num_hidden_layers=4),
    "granitemoehybrid": dict(BASE, model_type="granitemoehybrid", num_hidden_layers=4, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                             embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0,
                             residual_multiplier=1.0, layer_types=["mamba", "attention", "mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_proj_bias=False, mamba_d_state=16,
                             mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, position_embedding_type="rope",
                             rope_theta=1e4, tie_word_embeddings=True),
    "falcon_h1": dict(BASE, model_type="falcon_h1", num_hidden_layers=2, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                      mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_expand=2,
                      mamba_chunk_size=64, mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=False,
                      mamba_norm_before_gate=False, tie_word_embeddings=False),
}

# Recurrent layers only: refused at load (no attention layer to keep beside the state).
RECURRENT: dict[str, dict[str, Any]] = {
    "mamba": dict(vocab_size=VOCAB, hidden_size=32, model_type="mamba", intermediate_size=64, state_size=4,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4),
}


def build(config: dict[str, Any], seed: int = 7) -> Any:
    """The family's mlx-lm model with random float32 weights (evaluated)."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Random weights small enough that every layer's output stays in range.
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    # Recurrent state that fades over hundreds of tokens, as trained models' long-memory heads'
    # does (decay exp(-exp(A_log) dt) a token): the default init forgets within a few tokens,
    # so a warm turn resumed from a lost or wrong state would still give the cold tokens.
    model.load_weights([(name, mx.full(p.shape, SLOW_DECAY_LOG)) for name, p in tree_flatten(model.parameters())
                        if name.endswith("A_log")], strict=False)
    mx.eval(model.parameters())
    return model


def save(family: str, out: Path, tokenizer_dir: Path, seed: int = 7) -> Path:
    """Save a tiny random model of ``family`` at ``out`` with SmolLM2's tokenizer; returns ``out``."""
    from mlx_lm.utils import save_model

    config = {**(ATTENTION.get(family) or HYBRID.get(family) or RECURRENT[family])}
    model = build(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    config["eos_token_id"] = tokenizer_config.get("eos_token_id")
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            (out / name).symlink_to(tokenizer_dir / name)
    return out


def n_parameters(model: Any) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def module_of(family: str) -> Any:
    config = ATTENTION.get(family) or HYBRID[family]
    return importlib.import_module(f"mlx_lm.models.{config['model_type']}")
