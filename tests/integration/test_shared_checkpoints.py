"""Shared checkpoints of hybrid models (issue 37 item 2): a checkpoint of the recurrent state
taken at a block boundary by a turn that began from shared data only is kept with the block
that ends there, so another agent's new conversation starting with the same tokens (the same
system prompt) resumes there: the shared blocks' KV and that state, with exactly the logits
a cold prefill of its prompt gives; from disk after a restart (verified against the index),
an earlier one when the latest is damaged (quarantined), and gone with its block. Tiny
random models of two hybrid families (Qwen3.5: ``ArraysCache`` layers; Falcon-H1: a
``CacheList`` in every layer)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from sqlalchemy import delete, update

from app.cache import checkpoints, upkeep
from app.cache.blocks import BLOCK_TOKENS
from app.cache.checkpoints import CacheLayout, CheckpointPlan
from app.cache.files import CHECKSUM_KEY, QUARANTINE, SHARED_CHECKPOINT_SUFFIX, read, read_metadata, write
from app.cache.formats import KV_FORMATS
from app.cache.records import CacheRecord
from app.store.db import make_engine, make_session_factory
from app.clock import utcnow
from app.store.models import Block, CacheBlock
from support.families import HYBRID, build
from test_cache_round_trips import as_prompt, manager
from test_checkpoints import TOKENS, prefill

FAMILIES = ["qwen3_5", "falcon_h1"]
F32 = KV_FORMATS["f32"]
SYSTEM = 800  # the shared start: 3 whole blocks and 32 tokens


def turn(caches: Any, model: Any, agent: str, conversation: str, tokens: list[int]) -> Any:
    """A first turn as the engine runs it: lease, prefill with the lease's plan, commit.
    Returns the lease (as it was before the prefill: its reuse)."""
    lease = caches.lease(agent, conversation, as_prompt(tokens))
    reused = lease.n_reused, lease.report.reason
    assert lease.plan is not None
    lease.plan.positions = checkpoints.plan(lease.n_reused, len(tokens))
    prefill(model, lease.cache, tokens[lease.n_reused:], lease.n_reused, lease.plan)
    prompt = as_prompt(tokens)
    caches.commit(lease, CacheRecord(prompt.token_ids, prompt.text, prompt.ends), lease.cache)
    return reused


def cold(model: Any, layout: CacheLayout, tokens: list[int]) -> mx.array:
    """The last logits of a cold prefill of ``tokens``, as the engine runs one."""
    return prefill(model, model.make_cache(), tokens, 0, CheckpointPlan(layout, checkpoints.plan(0, len(tokens))))


def prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(3)
    system = rng.integers(100, TOKENS, SYSTEM).tolist()
    return system + rng.integers(100, TOKENS, 40).tolist(), system + rng.integers(100, TOKENS, 50).tolist()


def setup(family: str, tmp_path: Path) -> tuple[Any, CacheLayout, Any, list[int], list[int]]:
    """A model, and a manager where agent a's conversation stored the shared start's checkpoints."""
    model = build(HYBRID[family])
    layout = CacheLayout.of(model)
    first, second = prompts()
    caches = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    assert turn(caches, model, "a", "a-1", first) == (0, "miss")
    return model, layout, caches, first, second


def resume(caches: Any, model: Any, layout: CacheLayout, tokens: list[int], expect: int) -> int:
    """Agent b's new conversation reuses ``expect`` tokens of the shared start, and its
    logits are a cold prefill's; without the checkpoint's state they are not. Returns the
    tokens its lease reused."""
    lease = caches.lease("b", "b-1", as_prompt(tokens))
    assert (lease.n_reused, lease.report.reason) == (expect, "shared")
    assert lease.plan is not None and [p.n_tokens for p in lease.plan.taken] == [expect]
    warm = prefill(model, lease.cache, tokens[expect:], expect, None)
    reference = cold(model, layout, tokens)
    assert mx.array_equal(warm, reference)
    start = model.make_cache()
    prefill(model, start, tokens[:expect], 0, None)
    emptied = layout.assemble(layout.attention(start), None)  # the same KV, no recurrent state
    without_state = prefill(model, emptied, tokens[expect:], expect, None)
    assert not mx.allclose(without_state, reference, atol=1e-4)  # the state matters: this test can fail
    return lease.n_reused


def state_files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "blocks").rglob(f"*{SHARED_CHECKPOINT_SUFFIX}") if QUARANTINE not in p.parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_another_agent_resumes_a_shared_system_prompt_at_its_last_whole_block(family: str, tmp_path: Path) -> None:
    model, layout, caches, _, second = setup(family, tmp_path)
    assert resume(caches, model, layout, second, 3 * BLOCK_TOKENS) == 3 * BLOCK_TOKENS
    caches.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_checkpoints_come_back_from_disk_and_go_with_their_blocks(family: str, tmp_path: Path) -> None:
    model, layout, caches, first, second = setup(family, tmp_path)
    assert caches.flush(30)
    caches.close()
    assert len(state_files(tmp_path)) == 3  # after blocks 1, 2 and 3 (plan: 256, 512, 768)
    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    resume(reloaded, model, layout, second, 3 * BLOCK_TOKENS)
    # A turn from a conversation's own cache shares nothing more (its start may be an import's).
    more = np.random.default_rng(4).integers(100, TOKENS, 300).tolist()  # a checkpoint at 1024 too
    assert turn(reloaded, model, "a", "a-1", first + more)[1] == "extend"
    # Nor one resumed from another conversation's record (its agent's sibling).
    assert turn(reloaded, model, "a", "a-2", second[:SYSTEM] + more) == (3 * BLOCK_TOKENS, "sibling")
    assert reloaded.flush(30)
    assert len(state_files(tmp_path)) == 3
    assert reloaded.forget_agent("a")(60)  # b's conversation was never committed: the blocks go, and their states
    assert reloaded.flush(30)
    assert state_files(tmp_path) == []
    reloaded.close()


@pytest.mark.parametrize("family,damage", [(f, d) for f in FAMILIES for d in ("flipped", "forged")])
def test_a_damaged_shared_checkpoint_is_a_miss_and_an_earlier_one_serves(family: str, damage: str,
                                                                       tmp_path: Path) -> None:
    model, layout, caches, _, second = setup(family, tmp_path)
    assert caches.flush(30)
    caches.close()
    damaged = next(p for p in state_files(tmp_path) if read_metadata(p)["n_tokens"] == str(3 * BLOCK_TOKENS))
    if damage == "flipped":  # fails its own checksum
        data = bytearray(damaged.read_bytes())
        data[-8] ^= 0xFF
        damaged.write_bytes(bytes(data))
    else:  # another state with its own checksum recomputed: only the index's checksum refuses it
        arrays, meta = read(damaged)
        write(damaged, {name: np.zeros_like(array) for name, array in arrays.items()},
              {k: v for k, v in meta.items() if k != CHECKSUM_KEY})
    reloaded = manager(tmp_path, layout.n_attention, kv_format=F32, layout=layout)
    resume(reloaded, model, layout, second, 2 * BLOCK_TOKENS)
    assert not damaged.exists() and (tmp_path / "blocks" / QUARANTINE / damaged.name).exists()
    reloaded.close()


@pytest.mark.parametrize("job", ["expire", "compact"])
def test_the_workers_jobs_delete_shared_checkpoints_with_their_blocks(job: str, tmp_path: Path) -> None:
    _, _, caches, _, _ = setup("qwen3_5", tmp_path)
    assert caches.flush(30)
    caches.close()
    assert len(state_files(tmp_path)) == 3
    engine = make_engine(f"sqlite:///{tmp_path / 'semantic.db'}")
    sessions = make_session_factory(engine)
    if job == "expire":  # the conversation's cache goes cold: its blocks, and their states, go
        assert upkeep.run_expire(sessions, default_ttl_s=0)["files_deleted"] == 1 + 3 + 3
    else:  # blocks no cache references any more (compact drops them): their states go along
        with sessions.begin() as session:  # (as if the conversation had moved on to other blocks)
            session.execute(delete(CacheBlock))
            session.execute(update(Block).values(ref_count=0, last_access_at=utcnow() - timedelta(days=1)))
        assert upkeep.run_compact(engine, sessions, tmp_path / "blocks")["unreferenced_blocks"] == 3 + 3  # their files
    assert state_files(tmp_path) == []
