"""Which mlx-lm architectures the engine serves: those whose layers keep attention keys
and values, and hybrids whose other layers keep recurrent state (``ArraysCache``, kept as
checkpoints) beside at least one attention layer, or both in each layer (a ``CacheList``:
Falcon-H1) (tiny random-weight models of each kind,
built in-process); and where a prefill takes its checkpoints, and which a conversation keeps."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from mlx_lm.models.cache import CacheList

from app.cache.checkpoints import MAX_CHECKPOINTS, Checkpoint, CheckpointPlan, CacheLayout, keep, plan
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


HYBRID = {
    "lfm2": dict(model_type="lfm2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 intermediate_size=32, layer_types=["conv", "full_attention", "conv"]),
    "falcon_h1": dict(model_type="falcon_h1", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_d_conv=4),
}


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_models_of_recurrent_layers_only_are_refused_by_name(family: str) -> None:
    assert unsupported_caches(_build(RECURRENT[family])) == ["ArraysCache (and no attention layer)"]


def test_hybrid_models_are_served_with_their_layout() -> None:
    model = _build(HYBRID["lfm2"])
    assert unsupported_caches(model) == []
    layout = CacheLayout.of(model)
    assert layout.kinds == ("state:1", "kv", "state:1") and layout.hybrid and layout.n_attention == 1
    cache = layout.assemble(["kv0"], None)
    assert layout.attention(cache) == ["kv0"] and len(layout.recurrent(cache)) == 2
    assert not CacheLayout.of(_build(ATTENTION["llama"])).hybrid


def test_a_model_keeping_state_and_kv_in_each_layer_is_served_with_both_parts() -> None:
    """Falcon-H1: every layer's cache is mlx-lm's ``CacheList(ArraysCache(2), KVCache())``."""
    model = _build(HYBRID["falcon_h1"])
    assert unsupported_caches(model) == []
    layout = CacheLayout.of(model)
    assert layout.kinds == ("state:2+kv", "state:2+kv") and layout.hybrid
    assert layout.n_attention == layout.n_recurrent == 2
    point = Checkpoint(5, (("a0", "b0"), ("a1", "b1")))
    cache = layout.assemble(["kv0", "kv1"], point)
    assert [type(entry) for entry in cache] == [CacheList, CacheList]
    assert layout.attention(cache) == ["kv0", "kv1"]
    assert [state.cache for state in layout.recurrent(cache)] == [["a0", "b0"], ["a1", "b1"]]
    assert CacheLayout.of_cache(model.make_cache()) == layout


def test_a_prefill_stops_at_its_end_and_at_blocks_spaced_back_from_it() -> None:
    assert plan(0, 100) == (100,)
    # 1, 2 and 4 blocks before the end, on a block, and the last block boundary before it
    assert plan(0, 2000) == (768, 1280, 1536, 1792, 2000)
    assert plan(1900, 2000) == (2000,)
    assert plan(1500, 2000) == (1536, 1792, 2000)
    assert plan(0, 1024) == (512, 768, 1024)
    assert plan(10, 10) == ()
    point = CheckpointPlan(CacheLayout(("kv",)), positions=(256, 700))
    assert [point.chunk(0, 512), point.chunk(256, 512), point.chunk(700, 64)] == [256, 444, 64]


def test_a_conversation_keeps_its_newest_checkpoints_and_spaced_older_ones() -> None:
    points = [Checkpoint(n, ()) for n in (100, 200, 300, 400, 500, 600, 700, 800, 900, 990, 1000)]
    # The newest two, then each at least twice as far back from the newest as the last kept.
    assert [p.n_tokens for p in keep(points)] == [200, 600, 800, 900, 990, 1000]
    assert MAX_CHECKPOINTS == 6
    assert [p.n_tokens for p in keep(points[:3])] == [100, 200, 300]
