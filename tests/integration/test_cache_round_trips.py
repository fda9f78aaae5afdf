"""Tiny random models of each supported family: trim / extend / persist / reload.

Structural properties need no trained weights: for llama, qwen2, gemma3
(sliding window) and gpt_oss (attention sinks, sliding window) a prefix served
from the cache manager, in memory or reloaded from disk by a new manager,
gives exactly the logits of a cold prefill with the same token split and the
same 4-bit cache format.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from app.cache.blocks import BLOCK_TOKENS, KVBlock, join_blocks, quantize_span, slice_block, to_working_cache
from app.cache.formats import DEFAULT_KV_FORMAT, KV_FORMATS, KVFormat
from app.cache.manager import CacheManager
from app.cache.records import CacheRecord
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import Prompt
from support.dbcheck import query
from support.history_rows import add_conversations
from support.pool_check import check_pool

VOCAB = 300
FAMILIES = {
    "llama": dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB),
    "qwen2": dict(model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=256, num_hidden_layers=3, intermediate_size=256,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=VOCAB,
                        sliding_window=48, sliding_window_pattern=3, query_pre_attn_scalar=64),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=256, num_hidden_layers=2, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=48,
                    layer_types=["sliding_attention", "full_attention"]),
}


def build(family: str):  # type: ignore[no-untyped-def]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(FAMILIES[family]))
    model.set_dtype(mx.float32)
    if family == "gpt_oss":  # non-zero sinks, so they matter
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model


def as_prompt(tokens: list[int]) -> Prompt:
    """One character per token: the text spells the tokens, ends are 1..n."""
    return Prompt("".join(chr(0x4E00 + t) for t in tokens), tuple(tokens), tuple(range(1, len(tokens) + 1)))


def forward(model, cache, tokens: list[int]) -> mx.array:  # type: ignore[no-untyped-def]
    """Prefill in chunks of 64 like the engine, return the last position's logits."""
    logits = None
    for start in range(0, len(tokens), 64):
        logits = model(mx.array([tokens[start:start + 64]]), cache=cache)
        mx.eval(logits)
    assert logits is not None
    return logits[0, -1]


def cold_same_split(model, n_layers: int, prefix: list[int], suffix: list[int],  # type: ignore[no-untyped-def]
                    kv_format: KVFormat = DEFAULT_KV_FORMAT, prefilled: list[int] | None = None) -> mx.array:
    """Prefill the prefix cold (as part of ``prefilled``, if the stored turn was longer:
    the same split), pass it through the stored format, then the suffix."""
    prefilled = prefilled or prefix
    cache = to_working_cache([], n_layers, 0, mx.float32)
    forward(model, cache, prefilled)
    stored = quantize_span(cache, 0, len(prefilled), kv_format)
    return forward(model, to_working_cache([stored], n_layers, len(prefix), mx.float32, kv_format), suffix)


# The conversations each agent's turns use in these tests, test_shared_checkpoints.py's and
# test_cache_poisoning.py's (a fork's conversation is made by the API, before the copy).
CONVERSATIONS = {"a": ("a-c", "main", "side", "third", "a-1", "a-2", "c"), "b": ("b-c", "b-1", "other", "neighbour"),
                 "h": ("honest",), "forked": ("fork",)}


def manager(home: Path, n_layers: int, fingerprint: str = "fp-test", agents: tuple[str, ...] = ("a", "b"),
            **options: Any) -> CacheManager:
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    for agent in agents:  # agents and conversations exist (foreign keys), as the API ensures
        add_conversations(sessions, agent, CONVERSATIONS.get(agent, (f"{agent}-c",)))
    return CacheManager(fingerprint=fingerprint, n_layers=n_layers, dtype=mx.float32, blocks_dir=home / "blocks",
                        sessions=sessions, budget_bytes=1 << 30, **options)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_extend_trim_persist_reload_keep_logits(family: str, tmp_path: Path) -> None:
    model = build(family)
    n_layers = len(model.layers)
    rng = np.random.default_rng(0)
    first = rng.integers(0, VOCAB, 300).tolist()  # one full block and a partial tail
    more = rng.integers(0, VOCAB, 40).tolist()
    caches = manager(tmp_path, n_layers)

    lease = caches.lease("a", "a-c", as_prompt(first))
    assert lease.n_reused == 0
    forward(model, lease.cache, first)
    caches.commit(lease, CacheRecord(*_record_fields(first)), lease.cache)

    # EXTEND in memory: every cached token reused, same logits as cold with the same split.
    lease = caches.lease("a", "a-c", as_prompt(first + more))
    assert (lease.n_reused, lease.report.reason) == (300, "extend")
    warm = forward(model, lease.cache, more)
    assert mx.array_equal(warm, cold_same_split(model, n_layers, first, more))

    # Trim: diverge inside the tail.
    edited = first[:280] + [(first[280] + 1) % VOCAB] + more
    lease = caches.lease("a", "a-c", as_prompt(edited))
    assert (lease.n_reused, lease.report.reason) == (280, "diverge")
    assert mx.array_equal(forward(model, lease.cache, edited[280:]),
                          cold_same_split(model, n_layers, first[:280], edited[280:], prefilled=first))

    # Persist and reload in a new manager (a restart): the same logits, bit for bit.
    caches.flush(30)
    reloaded = manager(tmp_path, n_layers)
    lease = reloaded.lease("a", "a-c", as_prompt(first + more))
    assert lease.n_reused == 300
    assert mx.array_equal(forward(model, lease.cache, more), warm)
    reloaded.close()
    caches.close()


def test_every_format_has_its_own_fingerprint_and_the_documented_size() -> None:
    assert DEFAULT_KV_FORMAT is KV_FORMATS["q4c"]
    # Formats unchanged since caches were first stored in them keep their strings (their caches still match).
    assert KV_FORMATS["q4r"].fingerprint == "affine-q4-hadamard-g64-s16-b256"
    assert KV_FORMATS["q4c"].fingerprint == "affine-q4-kchannel-vhadamard-g64-s16-b256"
    assert KV_FORMATS["k5c"].fingerprint == "affine-k5v4-kchannel-vhadamard-g64-s16-b256"
    assert KV_FORMATS["k6v4"].fingerprint == "affine-k6v4-hadamard-g64-s16-b256"
    assert KV_FORMATS["k8v4"].fingerprint == "affine-k8v4-vhadamard-g64-s16-b256"  # values rotated since k5c
    assert KV_FORMATS["q8"].fingerprint == "affine-q8-g64-s16-b256"
    assert KV_FORMATS["f16"].fingerprint == "float16-b256"
    assert KV_FORMATS["f32"].fingerprint == "float32-b256"
    assert len({f.fingerprint for f in KV_FORMATS.values()}) == len(KV_FORMATS)
    # Bytes per token relative to FP16 (data and a float16 scale and bias per 64 values): the documented figures.
    assert [round(f.bytes_vs_fp16, 3) for f in KV_FORMATS.values()] == [0.281, 0.281, 0.312, 0.344, 0.406, 0.531, 1.0, 2.0]


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_every_kv_format_reuses_and_reloads_exactly(name: str, tmp_path: Path) -> None:
    kv_format = KV_FORMATS[name]
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(3)
    first, more = rng.integers(0, VOCAB, 400).tolist(), rng.integers(0, VOCAB, 40).tolist()
    caches = manager(tmp_path, n_layers, kv_format=kv_format)
    store_turn(caches, model, "a-c", first)
    stored = caches._blocks[caches._hot["a-c"].chain[0]]
    head_dim = model.layers[0].self_attn.head_dim
    arrays = dict(zip(stored.names, stored.layers[0]))
    if kv_format.channel_keys:  # each channel of 256 tokens: 4 groups of 64 along time, no float16 tail
        assert arrays["k_w"].shape[-2:] == (head_dim, BLOCK_TOKENS * kv_format.key_bits // 32)
        assert arrays["k_s"].shape[-2:] == (head_dim, BLOCK_TOKENS // 64) and arrays["k_t"].shape[2] == 0
        tail = caches._hot["a-c"].tail  # tokens 256-399: one more group, then the newest 80 keys in float16
        assert (tail.n_tokens, tail.n_grouped) == (144, 64)
        assert tail.layers[0][3].shape[2] == 80 and tail.layers[0][3].dtype == mx.float16
    elif not kv_format.quantized:
        assert arrays["k"].dtype == arrays["v"].dtype == kv_format.float_dtype and arrays["k"].shape[-1] == head_dim
    else:
        assert arrays["k_w"].shape[-1] * 32 // head_dim == kv_format.key_bits  # keys packed at their bits
        assert arrays["v_w"].shape[-1] * 32 // head_dim == kv_format.value_bits
    caches.flush(30)
    reloaded = manager(tmp_path, n_layers, kv_format=kv_format)
    lease = reloaded.lease("a", "a-c", as_prompt(first + more))
    assert (lease.n_reused, lease.report.reason) == (400, "extend")
    warm = forward(model, lease.cache, more)
    assert mx.array_equal(warm, cold_same_split(model, n_layers, first, more, kv_format))
    other = KV_FORMATS["q4c" if name == "q4r" else "q4r"]
    assert not mx.array_equal(warm, cold_same_split(model, n_layers, first, more, other))  # the format matters
    reloaded.close()
    caches.close()


def store_turn(caches: CacheManager, model, conversation: str, tokens: list[int]) -> int:  # type: ignore[no-untyped-def]
    """One turn of agent "a": lease, prefill what is not reused, commit. Returns the tokens reused."""
    lease = caches.lease("a", conversation, as_prompt(tokens))
    forward(model, lease.cache, tokens[lease.n_reused:])
    caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    return lease.n_reused


def _record_fields(tokens: list[int]) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
    prompt = as_prompt(tokens)
    return prompt.token_ids, prompt.text, prompt.ends


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_full_caches_match_the_models_own_sliding_window_caches(family: str) -> None:
    """Semantic keeps every token for sliding-window layers (so any prefix can be
    reused) and relies on the window mask; the result equals mlx-lm's rotating cache."""
    model = build(family)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 200).tolist()
    native = forward(model, model.make_cache(), tokens)
    ours = forward(model, to_working_cache([], len(model.layers), 0, mx.float32), tokens)
    assert mx.allclose(native, ours, atol=1e-4, rtol=1e-4)


def test_over_budget_agents_spill_to_disk_and_come_back(tmp_path: Path) -> None:
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(2)
    caches = manager(tmp_path, n_layers, working_copies=1)  # the 4-bit caches themselves over budget
    prompts = {agent: rng.integers(0, VOCAB, 300).tolist() for agent in ("a", "b")}
    for agent, tokens in prompts.items():
        lease = caches.lease(agent, agent + "-c", as_prompt(tokens))
        forward(model, lease.cache, tokens)
        caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    one_agent = caches.stats().pool_bytes // 2
    caches._pool.budget_bytes = int(one_agent * 1.5)  # room for one agent only
    more = rng.integers(0, VOCAB, 20).tolist()
    lease = caches.lease("b", "b-c", as_prompt(prompts["b"] + more))
    forward(model, lease.cache, more)
    record = CacheRecord(*_record_fields(prompts["b"] + more))
    caches.flush(30)
    caches.commit(lease, record, lease.cache)
    assert caches.stats().hot_agents == 1 and caches.record("a-c") is None  # "a" went warm
    caches.flush(30)
    lease = caches.lease("a", "a-c", as_prompt(prompts["a"] + more))  # warm -> hot from disk
    assert (lease.n_reused, lease.report.reason) == (300, "extend")
    assert mx.array_equal(forward(model, lease.cache, more), cold_same_split(model, n_layers, prompts["a"], more))
    caches.close()


def test_float_working_copies_go_before_any_4bit_cache(tmp_path: Path) -> None:
    """Over budget, the older conversation's float copy is dropped and its 4-bit cache
    stays hot; its next turn rebuilds the float copy from the blocks, same logits."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(5)
    caches = manager(tmp_path, n_layers)
    prompts = {agent: rng.integers(0, VOCAB, 300).tolist() for agent in ("a", "b")}
    for agent, tokens in prompts.items():
        lease = caches.lease(agent, agent + "-c", as_prompt(tokens))
        forward(model, lease.cache, tokens)
        caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    more = rng.integers(0, VOCAB, 20).tolist()
    lease = caches.lease("b", "b-c", as_prompt(prompts["b"] + more))
    forward(model, lease.cache, more)
    caches.commit(lease, CacheRecord(*_record_fields(prompts["b"] + more)), lease.cache)
    assert list(caches._working) == ["a-c", "b-c"]
    caches._pool.budget_bytes = caches.stats().pool_bytes - 1  # one float copy too many
    caches._memory.enforce_budget(keep="b-c")  # what every commit ends with
    assert list(caches._working) == ["b-c"] and caches.record("a-c") is not None and caches.stats().n_spilled == 0
    lease = caches.lease("a", "a-c", as_prompt(prompts["a"] + more))
    assert (lease.n_reused, lease.report.reason) == (300, "extend")
    assert mx.array_equal(forward(model, lease.cache, more), cold_same_split(model, n_layers, prompts["a"], more))
    caches.close()


def test_a_side_request_starts_from_the_main_conversations_float_copy(tmp_path: Path) -> None:
    """A sibling lease copies the first tokens of the other conversation's float copy
    (no dequantization), leaves that copy whole, and computes what a rebuild would."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(6)
    caches = manager(tmp_path, n_layers)
    main = rng.integers(0, VOCAB, 400).tolist()
    lease = caches.lease("a", "main", as_prompt(main))
    forward(model, lease.cache, main)
    caches.commit(lease, CacheRecord(*_record_fields(main)), lease.cache)
    copy = caches._working["main"]
    before = [np.array(layer.keys, copy=True) for layer in copy]
    side = main[:320] + rng.integers(0, VOCAB, 30).tolist()  # 320: a key group's end (q4c)
    lease = caches.lease("a", "side", as_prompt(side))
    assert (lease.n_reused, lease.report.reason) == (320, "sibling")
    out = forward(model, lease.cache, side[320:])
    assert caches._working["main"] is copy and copy[0].offset == 400
    assert all(np.array_equal(a, np.array(layer.keys)) for a, layer in zip(before, copy))
    assert mx.array_equal(out, cold_same_split(model, n_layers, main[:320], side[320:], prefilled=main))
    caches.close()


def test_a_hot_ttl_sends_an_unused_agent_to_disk(tmp_path: Path) -> None:
    """Anthropic cache_control: an agent kept hot for N seconds goes warm when
    unused that long, and comes back from disk unchanged."""
    model = build("llama")
    now = [1000.0]
    caches = manager(tmp_path, len(model.layers), agents=("brief", "lasting", "no hint"), clock=lambda: now[0])
    rng = np.random.default_rng(5)
    prompts = {agent: rng.integers(0, VOCAB, 300).tolist() for agent in ("brief", "lasting", "no hint")}
    for (agent, tokens), ttl in zip(prompts.items(), (300.0, 3600.0, None)):
        lease = caches.lease(agent, agent + "-c", as_prompt(tokens))
        forward(model, lease.cache, tokens)
        caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache, hot_ttl_s=ttl)
    assert caches.expire_hot() == []
    now[0] += 301
    assert caches.expire_hot() == ["brief-c"]
    assert caches.record("brief-c") is None and caches.record("lasting-c") and caches.record("no hint-c")
    caches.flush(30)
    more, tokens = [1, 2, 3], prompts["brief"]
    lease = caches.lease("brief", "brief-c", as_prompt(tokens + more))  # warm -> hot from disk
    assert (lease.n_reused, lease.report.reason) == (300, "extend")
    assert mx.array_equal(forward(model, lease.cache, more), cold_same_split(model, len(model.layers), tokens, more))
    caches.close()


def test_the_float_working_copy_counts_against_the_memory_budget(tmp_path: Path) -> None:
    model = build("llama")
    caches = manager(tmp_path, len(model.layers))
    tokens = np.random.default_rng(9).integers(0, VOCAB, 300).tolist()
    lease = caches.lease("a", "a-c", as_prompt(tokens))
    forward(model, lease.cache, tokens)
    caches.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    with_copy = caches.stats().pool_bytes
    caches.lease("a", "a-c", as_prompt(tokens + [1]))  # the lease takes the working copy out of the pool
    args = FAMILIES["llama"]
    float_bytes = 300 * args["num_hidden_layers"] * 2 * args["num_key_value_heads"] * \
        (args["hidden_size"] // args["num_attention_heads"]) * 4
    assert with_copy - caches.stats().pool_bytes >= float_bytes
    caches.close()


def test_conversations_of_one_agent_keep_their_own_caches(tmp_path: Path) -> None:
    """A side conversation starts from the main one's prefix without touching it; beyond
    ``max_conversations`` only the least recently used conversation's cache is deleted."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(11)
    caches = manager(tmp_path, n_layers, agents=("a",), max_conversations=2)
    shared = rng.integers(0, VOCAB, 300).tolist()
    main = shared + rng.integers(0, VOCAB, 60).tolist()
    lease = caches.lease("a", "main", as_prompt(main))
    forward(model, lease.cache, main)
    caches.commit(lease, CacheRecord(*_record_fields(main)), lease.cache)

    side = shared + rng.integers(0, VOCAB, 30).tolist()  # the same start, then its own
    lease = caches.lease("a", "side", as_prompt(side))
    assert (lease.n_reused, lease.report.reason) == (300, "sibling")
    assert lease.report.offset is not None and lease.report.offset > 0
    assert mx.array_equal(forward(model, lease.cache, side[300:]),
                          cold_same_split(model, n_layers, shared, side[300:], prefilled=main))
    caches.commit(lease, CacheRecord(*_record_fields(side)), lease.cache)
    assert caches.record("main") is not None and caches.record("main").tokens == tuple(main)  # untouched

    lease = caches.lease("a", "main", as_prompt(main + [5, 6]))
    assert (lease.n_reused, lease.report.reason) == (360, "extend")
    forward(model, lease.cache, [5, 6])
    caches.commit(lease, CacheRecord(*_record_fields(main + [5, 6])), lease.cache)

    third = rng.integers(0, VOCAB, 40).tolist()
    lease = caches.lease("a", "third", as_prompt(third))
    forward(model, lease.cache, third)
    caches.commit(lease, CacheRecord(*_record_fields(third)), lease.cache)
    caches.flush(30)
    assert caches.record("side") is None  # the least recently used of three: deleted
    assert caches.record("main") is not None and caches.record("third") is not None
    rows = query(tmp_path / "semantic.db", "SELECT conversation_id FROM caches ORDER BY conversation_id")
    assert rows == [("main",), ("third",)]
    check_pool(caches._pool)
    caches.close()


def test_per_channel_key_groups_complete_from_float16_keys_and_are_cut_only_at_their_start(tmp_path: Path) -> None:
    """q4c: the newest keys (64 to 127 tokens) stay float16; a later turn quantizes their
    groups from them (never from dequantized 4-bit data), and a reuse that ends inside a
    quantized group goes back to the group's start."""
    q4c = KV_FORMATS["q4c"]
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(13)
    first, more = rng.integers(0, VOCAB, 300).tolist(), rng.integers(0, VOCAB, 40).tolist()
    caches = manager(tmp_path, n_layers, kv_format=q4c)
    store_turn(caches, model, "a-c", first)
    stored = caches._hot["a-c"]
    assert (stored.chain, stored.tail.n_tokens, stored.n_grouped) == ((), 300, 192)  # 108 keys float16: no full block
    assert store_turn(caches, model, "a-c", first + more) == 300

    # Expected: turn 1 stored, turn 2 computed on top of exactly that, tokens 192-339
    # quantized then (groups up to 256 from their float16 keys; 256-339 float16).
    cache = to_working_cache([], n_layers, 0, mx.float32)
    forward(model, cache, first)
    turn1 = quantize_span(cache, 0, 300, q4c)
    cache = to_working_cache([turn1], n_layers, 300, mx.float32, q4c)
    forward(model, cache, more)
    expected = join_blocks([slice_block(turn1, 0, 192), quantize_span(cache, 192, 340, q4c)])
    stored = caches._hot["a-c"]
    assert (len(stored.chain), stored.tail.n_tokens, stored.n_grouped) == (1, 84, 256)
    got = join_blocks([caches._blocks[stored.chain[0]], stored.tail])
    assert all(mx.array_equal(a, b) for mine, theirs in zip(got.layers, expected.layers) for a, b in zip(mine, theirs))

    # Diverge at 200, inside the quantized group [192, 256): reuse goes back to 192.
    edited = first[:200] + [(first[200] + 1) % VOCAB]
    lease = caches.lease("a", "a-c", as_prompt(edited))
    assert (lease.n_reused, lease.report.reason) == (192, "diverge")
    # Diverge at 290, among the float16 keys: kept as is.
    edited = first[:290] + [(first[290] + 1) % VOCAB]
    lease = caches.lease("a", "a-c", as_prompt(edited))
    assert (lease.n_reused, lease.report.reason) == (290, "diverge")
    caches.close()


def test_per_channel_blocks_cut_and_join_only_at_group_boundaries() -> None:
    q4c = KV_FORMATS["q4c"]
    model = build("llama")
    cache = to_working_cache([], len(model.layers), 0, mx.float32)
    forward(model, cache, np.random.default_rng(17).integers(0, VOCAB, 200).tolist())
    block = quantize_span(cache, 0, 200, q4c)  # 2 quantized groups, the newest 72 keys float16
    assert (block.n_grouped, block.n_tokens) == (128, 200)
    whole = to_working_cache([block], len(model.layers), 200, mx.float32, q4c)
    parts = [slice_block(block, 0, 128), slice_block(block, 128, 200)]
    assert join_blocks(parts).n_tokens == 200
    rejoined = to_working_cache(parts, len(model.layers), 200, mx.float32, q4c)
    assert all(mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values) for a, b in zip(whole, rejoined))
    assert slice_block(block, 64, 196).n_tokens == 132  # a cut inside the float16 tail is fine
    with pytest.raises(ValueError):
        slice_block(block, 0, 100)  # inside a complete group
    with pytest.raises(ValueError):
        quantize_span(cache, 10, 200, q4c)  # a group must start on a boundary
    with pytest.raises(ValueError):
        join_blocks([slice_block(block, 0, 196), slice_block(block, 192, 200)])  # float16 keys in the middle
    block.check()
    with pytest.raises(ValueError):
        KVBlock(201, block.layers).check()  # arrays that do not cover the token count
    with pytest.raises(ValueError):
        KVBlock(200, tuple((*layer[:3], layer[3][:, :, :8], *layer[4:]) for layer in block.layers)).check()


def test_a_restart_brings_recent_conversations_back_before_they_are_asked_for(tmp_path: Path) -> None:
    """After a restart, ``prefetch`` loads the recently used conversations with their float
    working copies (an hour-old one stays on disk); the next turn takes the copy and
    computes what a reload from disk would, bit for bit. No room: nothing is loaded."""
    from sqlalchemy import update

    from app.clock import utcnow
    from app.store.models import Cache

    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(11)
    caches = manager(tmp_path, n_layers)
    prompts = {agent: rng.integers(0, VOCAB, 300).tolist() for agent in ("a", "b")}
    for agent, tokens in prompts.items():
        store_turn(caches, model, agent + "-c", tokens)
    caches.close()
    with caches._index.sessions.begin() as session:
        session.execute(update(Cache).where(Cache.conversation_id == "b-c")
                        .values(last_access_at=utcnow() - timedelta(hours=2)))

    full = manager(tmp_path, n_layers)
    full._pool.budget_bytes = 1
    assert full.prefetch() is False and full.record("a-c") is None and not full._working
    assert full.stats().n_spilled == 0  # not loaded, then spilled: not loaded at all
    full.close()

    reloaded = manager(tmp_path, n_layers)
    while reloaded.prefetch():  # a step at a time
        pass
    assert reloaded.record("a-c") is not None and reloaded.record("b-c") is None
    copy = reloaded._working["a-c"]
    more = rng.integers(0, VOCAB, 20).tolist()
    lease = reloaded.lease("a", "a-c", as_prompt(prompts["a"] + more))
    assert (lease.n_reused, lease.report.reason) == (300, "extend") and lease.cache is copy
    assert mx.array_equal(forward(model, lease.cache, more), cold_same_split(model, n_layers, prompts["a"], more))
    reloaded.close()


def test_a_prefetch_gives_way_to_requests_between_its_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restart a conversation comes back in steps: its files read on a thread of their
    own, then its working copy a layer at a time here while its blocks' checksums are checked
    there; it is in memory once they are. Another agent's turn runs while the files are read
    and between two steps, and the prefetch then completes; a turn of the conversation in
    flight takes the prefetch's result: nothing is read or dequantized twice, and the logits
    are those of a turn that read the cache itself."""
    from app.cache import loading
    from app.cache import manager as manager_module

    monkeypatch.setattr(loading, "PREFETCH_LAYERS", 1)
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(12)
    caches = manager(tmp_path, n_layers)
    prompts = {conversation: rng.integers(0, VOCAB, 300).tolist() for conversation in ("main", "side")}
    for conversation, tokens in prompts.items():  # "side" is the most recent: it comes back first
        store_turn(caches, model, conversation, tokens)
    caches.close()

    def gated(manager: CacheManager) -> tuple[threading.Event, list[str]]:
        """Hold ``manager``'s reads of conversation files until the event is set; count them."""
        gate, reads = threading.Event(), []
        read = manager._loader._files.read_conversation_unverified

        def held(entry: Any, *args: Any) -> Any:
            reads.append(entry.record_path)
            assert gate.wait(30)
            return read(entry, *args)

        monkeypatch.setattr(manager._loader._files, "read_conversation_unverified", held)
        return gate, reads

    layers_built: list[int] = []  # the prefetch's working-copy steps so far
    build_steps = loading.to_working_cache_steps

    def counted(*args: Any) -> Any:
        steps = build_steps(*args)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            layers_built.append(1)
            yield

    monkeypatch.setattr(loading, "to_working_cache_steps", counted)

    def turn_of_b(manager: CacheManager, tokens: list[int]) -> None:
        lease = manager.lease("b", "b-c", as_prompt(tokens))
        forward(model, lease.cache, tokens[lease.n_reused:])
        manager.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)

    restarted = manager(tmp_path, n_layers)
    if sys.platform == "linux":  # the reader yields the cores to requests (niceness is per thread there)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert restarted._loader._reader.submit(os.getpriority, os.PRIO_PROCESS, 0).result() == min(19, base + 10)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the engine's thread is left as it was
    gate, reads = gated(restarted)
    assert restarted.prefetch() is True  # "side" is being read
    other = rng.integers(0, VOCAB, 100).tolist()
    turn_of_b(restarted, other)  # another agent's turn, while the read waits
    assert restarted.record("side") is None and len(reads) == 1
    gate.set()
    while not layers_built:
        assert restarted.prefetch() is True
    # its first layer built: nothing of it in memory until every block is verified
    assert restarted.record("side") is None and "side" not in restarted._working
    history = other + rng.integers(0, VOCAB, 10).tolist()
    turn_of_b(restarted, history)  # and between two steps
    steps = 0
    while restarted.prefetch():
        steps += 1
    assert set(restarted._working) >= {"main", "side"} and steps >= n_layers and len(reads) == 2
    assert len(layers_built) == 2 * n_layers
    for conversation in ("main", "side"):
        cache = restarted._hot[conversation]
        blocks = [restarted._blocks[h] for h in cache.chain] + ([cache.tail] if cache.tail is not None else [])
        whole = to_working_cache(blocks, n_layers, 300, mx.float32)
        assert all(mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
                   for a, b in zip(whole, restarted._working[conversation]))
    restarted.close()

    again = manager(tmp_path, n_layers)
    gate, reads = gated(again)
    assert again.prefetch() is True  # "b-c", the most recent, is being read
    gate.set()
    monkeypatch.setattr(manager_module, "to_working_cache", None)  # the lease must not dequantize again
    more = rng.integers(0, VOCAB, 20).tolist()
    lease = again.lease("b", "b-c", as_prompt(history + more))
    assert (lease.n_reused, lease.report.reason, lease.report.source) == (110, "extend", "disk")
    assert again._loader._in_flight is None and len(reads) == 1
    monkeypatch.undo()
    prefetched = forward(model, lease.cache, more)
    again.close()
    plain = manager(tmp_path, n_layers)  # no prefetch: the turn reads the cache itself
    lease = plain.lease("b", "b-c", as_prompt(history + more))
    assert (lease.n_reused, lease.report.reason) == (110, "extend")
    assert mx.array_equal(prefetched, forward(model, lease.cache, more))
    plain.close()


def test_a_turn_stored_while_its_conversation_is_read_back_is_kept(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """While a restarted server reads a conversation back, a turn of that conversation that
    started from a sibling's cache stores it anew: what the prefetch read (older) is dropped,
    not put over the newer cache in memory."""
    model = build("llama")
    n_layers = len(model.layers)
    rng = np.random.default_rng(13)
    caches = manager(tmp_path, n_layers)
    prompts = {conversation: rng.integers(0, VOCAB, 300).tolist() for conversation in ("main", "side")}
    for conversation, tokens in prompts.items():  # "side" comes back first
        store_turn(caches, model, conversation, tokens)
    caches.close()

    restarted = manager(tmp_path, n_layers)
    gate = threading.Event()
    read = restarted._loader._files.read_conversation

    def held(entry: Any, *args: Any) -> Any:
        assert gate.wait(30)
        return read(entry, *args)

    monkeypatch.setattr(restarted._loader._files, "read_conversation", held)
    assert restarted.prefetch() is True  # "side" is being read
    monkeypatch.undo()  # the turn's own read of "main" goes straight through
    tokens = prompts["main"] + rng.integers(0, VOCAB, 40).tolist()
    lease = restarted.lease("a", "side", as_prompt(tokens))  # "main" shares the most: a sibling's cache
    assert (lease.n_reused, lease.report.reason) == (300, "sibling")
    forward(model, lease.cache, tokens[lease.n_reused:])
    restarted.commit(lease, CacheRecord(*_record_fields(tokens)), lease.cache)
    gate.set()
    while restarted.prefetch():
        pass
    record = restarted.record("side")
    assert record is not None and list(record.tokens) == tokens
    restarted.close()
