"""Which mlx-lm architectures the engine serves: those whose layers keep attention keys
and values (tiny random-weight models of each kind, built in-process)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from app.engine.model import unsupported_caches

VOCAB = 64
ATTENTION = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
                        sliding_window=48, sliding_window_pattern=3, query_pre_attn_scalar=16),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  tie_word_embeddings=True),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, num_hidden_layers=2, intermediate_size=32,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=48,
                    layer_types=["sliding_attention", "full_attention"]),
}
RECURRENT = {
    "mamba": dict(model_type="mamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, state_size=4,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4),
}


def _build(args: dict[str, Any]) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{args['model_type']}")
    return module.Model(module.ModelArgs.from_dict(args))


@pytest.mark.parametrize("family", sorted(ATTENTION))
def test_attention_models_are_served(family: str) -> None:
    assert unsupported_caches(_build(ATTENTION[family])) == []


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_models_with_recurrent_state_are_refused_by_name(family: str) -> None:
    assert unsupported_caches(_build(RECURRENT[family])) == ["ArraysCache"]
