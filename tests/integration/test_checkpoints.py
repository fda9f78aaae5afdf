"""Recurrent-state checkpoints of hybrid models, through the cache manager and its files
(issue 37): a turn stores its checkpoints, a new manager on the same home (a restart)
resumes an edited prompt at the latest checkpoint before the edit with exactly the logits
a cold prefill of the same split gives, and without the checkpoint's state they differ
(so the comparison can fail). Tiny random models of each served hybrid family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from app.cache import checkpoints
from app.cache.formats import KV_FORMATS
from app.cache.checkpoints import CacheLayout
from app.cache.records import CacheRecord
from app.types import ForkPoint
from support.families import HYBRID, build
from test_cache_round_trips import as_prompt, manager

SERVED = sorted(HYBRID)
F32 = KV_FORMATS["f32"]
TOKENS = 15000  # as_prompt spells token t as chr(0x4E00 + t): below the surrogates


def prefill(model: Any, cache: list[Any], tokens: list[int], start: int, plan: checkpoints.CheckpointPlan | None,
            step: int = 128) -> mx.array:
    """Feed ``tokens`` (after ``start`` cached ones) as the engine does: chunks that end at
    the plan's positions, a checkpoint taken at each. Returns the last logits."""
    at, logits = 0, None
    while at < len(tokens):
        n = plan.chunk(start + at, min(step, len(tokens) - at)) if plan else min(step, len(tokens) - at)
        logits = model(mx.array([tokens[at:at + n]]), cache=cache)
        mx.eval(logits)
        at += n
        if plan:
            plan.after_prefill(cache, start + at)
    assert logits is not None
    return logits[0, -1]


def store(caches: Any, model: Any, tokens: list[int]) -> None:
    lease = caches.lease("a", "a-c", as_prompt(tokens))
    assert lease.plan is not None and lease.n_reused == 0
    lease.plan.positions = checkpoints.plan(0, len(tokens))
    prefill(model, lease.cache, tokens, 0, lease.plan)
    prompt = as_prompt(tokens)
    caches.commit(lease, CacheRecord(prompt.token_ids, prompt.text, prompt.ends), lease.cache)


@pytest.mark.parametrize("family", SERVED)
def test_a_restart_resumes_an_edited_prompt_at_the_checkpoint_before_the_edit(family: str, tmp_path: Path) -> None:
    model = build(HYBRID[family])
    layout = CacheLayout.of(model)
    assert layout.hybrid and layout.n_attention > 0
    rng = np.random.default_rng(1)
    first = rng.integers(100, TOKENS, 700).tolist()
    edited = first[:450] + rng.integers(100, TOKENS, 30).tolist()  # the prompt changes at token 450
    caches = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    store(caches, model, first)
    # plan(0, 700): the prompt's end, the block boundary 1 block before it (2 blocks before
    # it is the start) and the last one before it.
    assert [p.n_tokens for p in caches._hot["a-c"].checkpoints] == [256, 512, 700]
    assert caches.flush(30)
    caches.close()

    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    lease = reloaded.lease("a", "a-c", as_prompt(edited))
    assert lease.n_reused == 256, lease.report  # the matched 450 tokens, back to the checkpoint
    warm = prefill(model, lease.cache, edited[256:], 256, None)

    cold_cache = model.make_cache()
    prefill(model, cold_cache, first[:256], 0, None)
    emptied = layout.assemble(layout.attention(cold_cache), None)  # the same KV, no recurrent state
    cold = prefill(model, cold_cache, edited[256:], 256, None)
    assert mx.array_equal(warm, cold), family
    without_state = prefill(model, emptied, edited[256:], 256, None)
    assert not mx.allclose(without_state, cold, atol=1e-4), family  # the state matters: this test can fail
    reloaded.close()


@pytest.mark.parametrize("family", SERVED)
def test_a_prefill_stopped_part_way_resumes_at_the_last_checkpoint_it_reached(family: str, tmp_path: Path) -> None:
    """Issue 58: a hybrid model's prefill cancelled (or checkpointed mid-way) commits what it
    computed, as ``Runner._keep_prefilled`` and ``Runner._checkpoint`` do: the record of the
    tokens prefilled so far, with the recurrent-state checkpoints reached by then and one of
    the state where it stopped. After a restart the whole prompt resumes there, with a cold
    prefill's logits."""
    model = build(HYBRID[family])
    layout = CacheLayout.of(model)
    tokens = np.random.default_rng(3).integers(100, TOKENS, 1400).tolist()
    caches = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    lease = caches.lease("a", "a-c", as_prompt(tokens))
    assert lease.plan is not None
    lease.plan.positions = checkpoints.plan(0, len(tokens))  # 256, 768, 1024, 1280, 1400
    prefill(model, lease.cache, tokens[:900], 0, lease.plan)  # stopped after 900 of 1,400 tokens
    done = as_prompt(tokens[:900])
    caches.commit(lease, CacheRecord(done.token_ids, done.text, done.ends), lease.cache)
    assert [p.n_tokens for p in caches._hot["a-c"].checkpoints] == [256, 768, 900]
    assert caches.flush(30)
    caches.close()

    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    resumed = reloaded.lease("a", "a-c", as_prompt(tokens))
    assert resumed.n_reused == 900, resumed.report  # where it stopped
    warm = prefill(model, resumed.cache, tokens[900:], 900, None)
    cold_cache = model.make_cache()
    prefill(model, cold_cache, tokens[:768], 0, None)  # the chunks the stopped prefill took
    prefill(model, cold_cache, tokens[768:900], 768, None)
    cold = prefill(model, cold_cache, tokens[900:], 900, None)
    assert mx.array_equal(warm, cold), family
    reloaded.close()


@pytest.mark.parametrize("family", SERVED)
def test_checkpoints_are_lossless_on_disk_and_a_damaged_one_is_a_miss(family: str, tmp_path: Path) -> None:
    model = build(HYBRID[family])
    layout = CacheLayout.of(model)
    tokens = np.random.default_rng(2).integers(100, TOKENS, 300).tolist()
    caches = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    store(caches, model, tokens)
    stored = caches._hot["a-c"].checkpoints
    assert caches.flush(30)
    caches.close()
    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    lease = reloaded.lease("a", "a-c", as_prompt(tokens + [5]))
    assert lease.n_reused == 300
    loaded = reloaded._hot["a-c"].checkpoints
    assert [p.n_tokens for p in loaded] == [p.n_tokens for p in stored]
    for a, b in zip(stored, loaded):
        for x, y in zip((x for s in a.states for x in s), (y for s in b.states for y in s)):
            assert x.dtype == y.dtype and mx.array_equal(x, y)
    reloaded.close()
    # A record file whose checkpoint bytes changed fails its checksum: the cache is a miss.
    record = next((tmp_path / "blocks").rglob("conversations/*.safetensors"))
    data = bytearray(record.read_bytes())
    data[-8] ^= 0xFF
    record.write_bytes(bytes(data))
    again = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    # Nothing of the damaged record is used. The shared checkpoint after its first block, a
    # file of its own, may still serve that block, or be gone already: the discarded
    # conversation left its blocks unreferenced, and the writer thread drops them (a race
    # the test does not pin; CI saw both).
    lease = again.lease("a", "a-c", as_prompt(tokens + [5]))
    assert (lease.n_reused, lease.report.reason) in ((256, "shared"), (0, "miss")), lease.report
    again.close()


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_a_fork_inside_a_turn_resumes_at_the_checkpoint_before_its_cut(family: str, tmp_path: Path) -> None:
    """A fork's copy of a hybrid conversation up to a point keeps the checkpoints at or
    before its cut, and the forked agent's next turn resumes at the latest of them with a
    cold prefill's logits; after a restart too."""
    model = build(HYBRID[family])
    layout = CacheLayout.of(model)
    rng = np.random.default_rng(4)
    first = rng.integers(100, TOKENS, 700).tolist()
    caches = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    store(caches, model, first)
    assert [p.n_tokens for p in caches._hot["a-c"].checkpoints] == [256, 512, 700]
    text = as_prompt(first).text
    point = ForkPoint(kept=(text[:600],), dropped=text[600:610])  # the fork leaves out tokens 600 on
    assert caches.fork("a-c", "b", "b-c", point).wait(60)
    assert [p.n_tokens for p in caches._hot["a-c"].checkpoints] == [256, 512, 700]  # the source is whole
    assert caches.flush(30)
    caches.close()

    more = rng.integers(100, TOKENS, 40).tolist()
    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    lease = reloaded.lease("b", "b-c", as_prompt(first[:600] + more))
    assert (lease.n_reused, lease.report.reason) == (512, "extend"), lease.report
    warm = prefill(model, lease.cache, (first[:600] + more)[512:], 512, None)
    cold_cache = model.make_cache()
    cold = prefill(model, cold_cache, first[:600] + more, 0, None)
    assert mx.array_equal(warm, cold), family
    reloaded.close()
