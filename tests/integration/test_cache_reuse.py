"""Cache reuse on the real SmolLM2 through the engine: warm equals cold, restart,
damaged files, sharing between agents, and the off switch."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from app.cache.blocks import BLOCK_TOKENS, join_blocks, quantize_span, requantize_start, slice_block, to_working_cache
from app.catalog.registry import Catalog
from app.engine.engine import Engine
from app.types import ChatMessage, Finished, SamplingParams
from support import engines
from support.dbcheck import query
from support.engines import cache_manager, conv, loaded_model

SYSTEM = ChatMessage("system", "You are a helpful assistant. " + "Answer briefly and precisely. " * 90)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


AGENTS = ("wc", "logits", "restart", "damaged", "share-a", "share-b", "off", "swap", "durable")


def make_engine_at(home: Path, model_dir: Path, **options: Any) -> Engine:
    return engines.make_engine_at(home, model_dir, AGENTS, **options)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache-home")


@pytest.fixture(scope="module")
def engine(home: Path, smollm2_dir: Path) -> Iterator[Engine]:
    running = make_engine_at(home, smollm2_dir)
    yield running
    running.stop()


def turn(engine: Engine, agent: str | None, messages: list[ChatMessage], sampling: SamplingParams = GREEDY,
         model: str | None = None) -> tuple[str, Finished]:
    return engines.turn(engine, agent, messages, sampling, model)


def conversation(engine: Engine, agent: str, system: ChatMessage = SYSTEM) -> tuple[list[ChatMessage], Finished, Finished]:
    first = [system, ChatMessage("user", "Name three primary colors.")]
    reply, f1 = turn(engine, agent, first)
    second = [*first, ChatMessage("assistant", reply), ChatMessage("user", "Now name three animals.")]
    _, f2 = turn(engine, agent, second)
    return second, f1, f2


def cold_same_split(engine: Engine, tokens: tuple[int, ...], splits: list[int], n_tokens: int,
                    cut: int | None = None) -> tuple[mx.array, list[int]]:
    """What a cold server computes for the same token split and cache format.

    ``tokens[:splits[-1]]`` is prefilled from scratch in the segments the warm
    path saw (one per turn, ``splits`` are the turn boundaries), passing the
    cache through the 4-bit format at every boundary, as a stored cache is;
    a reuse that stops short of the last boundary is ``cut``. Then the rest of
    ``tokens`` is prefilled and ``n_tokens`` are generated greedily. Returns the
    logits after ``tokens`` and the generated tokens.
    """
    loaded, kv_format = loaded_model(engine), cache_manager(engine).kv_format
    cache = to_working_cache([], loaded.n_layers, 0, mx.float32)
    stored: list = []  # 4-bit segments; quantized data is never quantized again
    done = 0
    for split in splits:
        for start in range(done, split, BLOCK_TOKENS):
            mx.eval(loaded.model(mx.array([tokens[start:min(start + BLOCK_TOKENS, split)]]), cache=cache))
        begin = requantize_start(stored, done, kv_format)
        stored = ([slice_block(join_blocks(stored), 0, begin)] if begin else []) + \
            [quantize_span(cache, begin, split, kv_format)]
        cache = to_working_cache(stored, loaded.n_layers, split, mx.float32, kv_format)
        done = split
    if cut is not None:
        cache, done = to_working_cache(stored, loaded.n_layers, cut, mx.float32, kv_format), cut
    logits = loaded.model(mx.array([tokens[done:]]), cache=cache)[0, -1]
    first = int(mx.argmax(logits))
    tokens_out = [first] + [int(t) for t, _ in generate_step(mx.array([first]), loaded.model, max_tokens=n_tokens - 1,
                                                             sampler=lambda lp: mx.argmax(lp, axis=-1), prompt_cache=cache)]
    return logits, tokens_out


def assert_second_turn_equals_cold(engine: Engine, agent: str, f1: Finished, f2: Finished) -> None:
    """Turn 2 extended turn 1's cache and generated what a cold prefill with the same
    split (one segment per turn, each through the stored format) generates."""
    assert f2.reuse.reason == "extend"
    # Turn 1's prompt and its whole reply were reused.
    assert f2.n_cached_tokens >= f1.n_prompt_tokens + f1.n_output_tokens - 1
    record = cache_manager(engine).record(conv(agent))
    assert record is not None
    prompt = record.tokens[:f2.n_prompt_tokens]
    splits = sorted({n for n in (f1.n_cached_tokens, f2.n_cached_tokens) if n})  # one per turn
    _, cold_tokens = cold_same_split(engine, prompt, splits, f2.n_output_tokens)
    assert tuple(cold_tokens) == f2.output_token_ids


def test_warm_turn_equals_cold_prefill_with_the_same_split(engine: Engine) -> None:
    _, f1, f2 = conversation(engine, "wc")
    assert f1.n_cache_written == f1.n_prompt_tokens - f1.n_cached_tokens
    assert_second_turn_equals_cold(engine, "wc", f1, f2)


def test_warm_logits_match_cold_within_tolerance(engine: Engine) -> None:
    _, f1, f2 = conversation(engine, "logits")
    record = cache_manager(engine).record(conv("logits"))
    assert record is not None
    k = record.n_tokens - 10  # inside turn 2's reply: turn 1 and turn 2 both shaped it
    from app.types import Prompt
    text = record.text[:record.ends[k - 1]] + "\u0000diverge"
    # The prompt's own tokens: the record's first k, then one for the divergent rest.
    lease = cache_manager(engine).lease("logits", conv("logits"),
                                Prompt(text, record.tokens[:k] + (0,), record.ends[:k] + (len(text),)))
    assert lease.n_reused == k
    suffix = record.tokens[k:]
    warm = loaded_model(engine).model(mx.array([suffix]), cache=lease.cache)[0, -1]
    splits = sorted({n for n in (f1.n_cached_tokens, f2.n_cached_tokens, record.n_tokens) if n})
    cold, _ = cold_same_split(engine, record.tokens, splits, 1, cut=k)
    assert int(mx.argmax(warm)) == int(mx.argmax(cold))
    warm_p, cold_p = mx.softmax(warm), mx.softmax(cold)
    # Only float noise differs (the engine's prefill chunks are sized by time, and replies
    # are decoded a token at a time), which 4-bit rounding amplifies: with keys quantized
    # per channel, a tiny change to one token can move its group's scale, and so the
    # dequantized keys of all 64 tokens by up to a step. Bounded on every token the model
    # gives at least 1%, and over the whole distribution.
    likely = mx.array([i for i in mx.argsort(cold)[-50:].tolist() if float(cold_p[i]) >= 0.01])
    assert float(mx.max(mx.abs(mx.log(warm_p[likely]) - mx.log(cold_p[likely])))) < 0.05
    assert float(mx.sum(mx.abs(warm_p - cold_p))) / 2 < 0.01


def test_restart_resumes_from_disk_with_the_same_answer(tmp_path: Path, smollm2_dir: Path) -> None:
    uninterrupted = make_engine_at(tmp_path / "a", smollm2_dir)  # turns 1, 2, 3 in one engine
    try:
        messages, _, _ = conversation(uninterrupted, "restart")
        record = cache_manager(uninterrupted).record(conv("restart"))
        assert record is not None
        marker = "<|im_start|>assistant\n"
        reply_2 = record.text[record.text.rindex(marker) + len(marker):].removesuffix("<|im_end|>")
        third = [*messages, ChatMessage("assistant", reply_2), ChatMessage("user", "And fruits?")]
        expected_text, expected = turn(uninterrupted, "restart", third)
    finally:
        uninterrupted.stop()

    first = make_engine_at(tmp_path / "b", smollm2_dir)  # turns 1, 2, stop, restart, turn 3
    conversation(first, "restart")
    first.stop()
    restarted = make_engine_at(tmp_path / "b", smollm2_dir)
    try:
        text, finished = turn(restarted, "restart", third)
        assert (finished.n_cached_tokens, finished.reuse.reason) == (expected.n_cached_tokens, "extend")
        assert finished.output_token_ids == expected.output_token_ids and text == expected_text
    finally:
        restarted.stop()


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, engine: Engine) -> tuple[Path, list, str]:
    """A home holding the "damaged" agent's two-turn conversation on disk, and what a cold
    prefill of the same prompt answers (every damage below starts from a copy of it)."""
    home = tmp_path_factory.mktemp("stored")
    first = make_engine_at(home, smollm2_dir)
    messages, _, _ = conversation(first, "damaged")
    first.stop()
    return home, messages, turn(engine, None, messages)[0]


@pytest.mark.parametrize("damage", ["corrupt block", "truncate record", "delete block", "wrong fingerprint"])
def test_damaged_cache_is_a_miss_with_a_correct_answer(tmp_path: Path, smollm2_dir: Path, damage: str,
                                                       engine: Engine, stored: tuple[Path, list, str]) -> None:
    shutil.copytree(stored[0], tmp_path, dirs_exist_ok=True)
    with sqlite3.connect(tmp_path / "semantic.db") as db:  # the index names files by absolute path
        db.execute("UPDATE blocks SET path = replace(path, ?, ?)", (str(stored[0]), str(tmp_path)))
        db.execute("UPDATE caches SET record_path = replace(record_path, ?, ?)", (str(stored[0]), str(tmp_path)))
    messages, cold_text = stored[1], stored[2]
    model_dir, options = smollm2_dir, {}
    blocks = sorted(p for p in (tmp_path / "blocks").rglob("*.safetensors") if "conversations" not in p.parts)
    record = next((tmp_path / "blocks").rglob("conversations/*.safetensors"))
    if damage == "corrupt block":
        data = bytearray(blocks[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        blocks[0].write_bytes(bytes(data))
    elif damage == "truncate record":
        os.truncate(record, record.stat().st_size // 2)
    elif damage == "delete block":
        blocks[0].unlink()
    else:  # the same weights with an edited chat template: another model fingerprint
        changed = tmp_path / "changed-model"
        changed.mkdir()
        for item in smollm2_dir.iterdir():
            (changed / item.name).symlink_to(item)
        (changed / "tokenizer_config.json").unlink()
        config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("You are a helpful AI assistant", "You are an AI")
        (changed / "tokenizer_config.json").write_text(json.dumps(config))
        model_dir = changed
        # Its own KV calibration would be measured again (its template is in the key, ~30 s):
        # the format the first model chose, set, leaves the fingerprint differing by the template.
        options["kv_format"] = loaded_model(engine).kv.format.name
    second = make_engine_at(tmp_path, model_dir, **options)
    try:
        text, finished = turn(second, "damaged", messages)
        # Never the agent's own (damaged) cache; at most undamaged shared blocks.
        assert finished.reuse.reason in ("miss", "shared")
        if finished.reuse.reason == "miss":
            assert text == cold_text  # a cold prefill of the same prompt
        else:
            record = cache_manager(second).record(conv("damaged"))
            assert record is not None
            _, tokens = cold_same_split(second, record.tokens[:finished.n_prompt_tokens],
                                        [finished.n_cached_tokens], finished.n_output_tokens)
            assert tuple(tokens) == finished.output_token_ids
        if damage in ("corrupt block", "truncate record"):
            assert list((tmp_path / "blocks" / "quarantine").iterdir())
        if damage == "wrong fingerprint":
            assert loaded_model(second).fingerprint != loaded_model(engine).fingerprint
    finally:
        second.stop()


def test_agents_with_the_same_system_prompt_share_blocks(engine: Engine, home: Path) -> None:
    _, fa = turn(engine, "share-a", [SYSTEM, ChatMessage("user", "Hello from A.")])
    blocks_after_a = cache_manager(engine).stats().n_blocks
    pool_after_a = cache_manager(engine).stats().pool_bytes
    _, fb = turn(engine, "share-b", [SYSTEM, ChatMessage("user", "Hello from B, a different question.")])
    assert fb.reuse.reason == "shared" and fb.n_cached_tokens >= BLOCK_TOKENS
    stats = cache_manager(engine).stats()
    shared_blocks = fb.n_cached_tokens // BLOCK_TOKENS
    new_full_blocks = (fb.n_prompt_tokens + fb.n_output_tokens) // BLOCK_TOKENS - shared_blocks
    assert stats.n_blocks == blocks_after_a + new_full_blocks  # shared blocks are held once
    assert stats.pool_bytes - pool_after_a < 0.8 * pool_after_a
    assert engines.flush_caches(engine, 60)
    rows = query(home / "semantic.db", "SELECT ref_count FROM blocks ORDER BY ref_count DESC LIMIT 1")
    assert rows[0][0] >= 2


def test_reuse_switch_off_prefills_everything(tmp_path: Path, smollm2_dir: Path) -> None:
    engine = make_engine_at(tmp_path, smollm2_dir, enabled=False)
    try:
        _, f1, f2 = conversation(engine, "off")
        assert f2.n_cached_tokens == 0 and f2.n_cache_written == 0 and f2.reuse.reason == "off"
        assert not (tmp_path / "blocks").exists() or not list((tmp_path / "blocks").rglob("*.safetensors"))
    finally:
        engine.stop()


def test_a_4bit_mlx_model_directory_serves_with_caches(tmp_path: Path, smollm2_dir: Path) -> None:
    """The common community layout: mlx-lm's own converter, 4-bit affine weights, group 64."""
    from mlx_lm.convert import convert

    q4_dir = tmp_path / "smollm2-4bit"
    convert(str(smollm2_dir), str(q4_dir), quantize=True, q_bits=4, q_group_size=64)
    assert json.loads((q4_dir / "config.json").read_text())["quantization"]["bits"] == 4
    engine = make_engine_at(tmp_path / "home", q4_dir, kv_format="k6v4")  # calibrating at 13 tokens/s: minutes
    try:
        assert type(loaded_model(engine).model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
        # Short turns: 4-bit matmuls skip BLAS on this CPU (13 prompt tokens/s, benchmarks/weights.py).
        _, f1, f2 = conversation(engine, "wc", ChatMessage("system", "Be brief."))
        assert_second_turn_equals_cold(engine, "wc", f1, f2)
    finally:
        engine.stop()
    rows = query(tmp_path / "home" / "semantic.db", "SELECT n_tokens FROM caches WHERE agent_id = 'wc'")
    assert rows and rows[0][0] >= f2.n_prompt_tokens


def test_warm_equals_cold_on_gemma3_beyond_its_sliding_window(tmp_path: Path, gemma3_dir: Path) -> None:
    """Gemma 3's local layers attend to the last 512 tokens; the cache keeps every token
    and the second turn (past 512) still gives what a cold prefill with the same split gives."""
    engine = make_engine_at(tmp_path, gemma3_dir)
    try:
        system = ChatMessage("system", SYSTEM.content + "Keep every answer short and plain. " * 25)
        _, f1, f2 = conversation(engine, "wc", system)
        assert f1.n_prompt_tokens > 512
        assert_second_turn_equals_cold(engine, "wc", f1, f2)
    finally:
        engine.stop()


def test_a_request_for_another_model_swaps_it_in_and_each_model_keeps_its_cache(
        tmp_path: Path, smollm2_dir: Path, gemma3_dir: Path) -> None:
    """Hot swap between two architectures with their own tokenizers: one conversation
    served by SmolLM2, then Gemma 3, then SmolLM2 again, which reads its turn 1 back
    from disk (the swap dropped it from memory) and answers as a cold prefill would."""
    catalog = Catalog.configure(tmp_path / "models", str(smollm2_dir), {"gemma": str(gemma3_dir)},
                                map_unknown=False)
    engine = make_engine_at(tmp_path / "home", smollm2_dir, catalog=catalog)
    first = [ChatMessage("system", "Be brief."), ChatMessage("user", "Name three primary colors.")]
    try:
        gemma = engine.resolve("gemma").name
        assert gemma == gemma3_dir.name and engine.resolve(None).name == smollm2_dir.name
        reply, f1 = turn(engine, "swap", first)
        gemma_reply, f_gemma = turn(engine, "swap", first, model=gemma)
        status = engine.status()
        assert (status.model, status.swaps) == (gemma, 1)
        assert f_gemma.n_cached_tokens == 0  # a model never reads another model's cache
        second = [*first, ChatMessage("assistant", reply), ChatMessage("user", "Now name three animals.")]
        _, f2 = turn(engine, "swap", second)
        assert (engine.status().model, engine.status().swaps) == (smollm2_dir.name, 2)
        assert_second_turn_equals_cold(engine, "swap", f1, f2)
    finally:
        engine.stop()
    fingerprints = query(tmp_path / "home" / "semantic.db",
                         "SELECT count(DISTINCT model_fingerprint) FROM caches WHERE agent_id = 'swap'")
    assert fingerprints == [(2,)]
    alone = make_engine_at(tmp_path / "gemma-alone", gemma3_dir)
    try:
        assert turn(alone, "swap", first)[0] == gemma_reply  # the swap loaded Gemma itself, cleanly
    finally:
        alone.stop()
