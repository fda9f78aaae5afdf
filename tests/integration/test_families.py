"""Warm equals cold on every tested architecture family (issue 37): tiny random-weight
models of each (tests/support/families.py), served by the whole engine with ``f32`` KV.

For each family a reused turn (later turns of a conversation, an edit in the middle of the
last message, and the same after a restart: a new engine on the same home) gives the same
greedy tokens as an engine with reuse off, which prefills the whole prompt cold. Hybrid
families keep recurrent state (mlx-lm's ``ArraysCache``) in some layers, or beside the
KV in every layer (falcon_h1's ``CacheList``): their reuse stops at the latest checkpoint
of that state at or before the matched prefix (app/cache/checkpoints.py), so these tests
also check that they reuse, and how much. Their random state fades slowly
(``families.SLOW_DECAY_LOG``), so a warm turn resumed without it gives other tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import pytest

from app.cache.blocks import to_working_cache
from app.engine.engine import Engine
from app.engine.model import load_model, warm_up
from app.errors import InvalidModelFile
from app.types import ChatMessage, SamplingParams
from support.engines import make_engine_at, turn
from support.families import ATTENTION, HYBRID, RECURRENT, save
from support.warm_cold import CASES, LONG_SYSTEM, agent_of, answer_pairs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SERVED_HYBRID = sorted(HYBRID)
# A long conversation, edited in its first user message, and a multi-turn one.
FAMILY_CASES = tuple(c for c in CASES if c.name in ("colors", "edit-word", "basil"))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: save(family, root / family, smollm2_dir) for family in (*ATTENTION, *HYBRID, *RECURRENT)}


def _engines(home: Path, model_dir: Path, family: str) -> tuple[Engine, Engine]:
    warm = make_engine_at(home / "warm", model_dir, [agent_of(c) for c in FAMILY_CASES], kv_format="f32",
                          name=family)
    cold = make_engine_at(home / "cold", model_dir, [], enabled=False, kv_format="f32", name=family)
    return warm, cold


@pytest.fixture(scope="module", params=[*ATTENTION, *SERVED_HYBRID])
def engines(request: pytest.FixtureRequest, family_dirs: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine, Engine]]:
    family = request.param
    warm, cold = _engines(tmp_path_factory.mktemp(f"wc-{family}"), family_dirs[family], family)
    yield family, warm, cold
    warm.stop()
    cold.stop()


def test_every_family_answers_warm_as_cold(engines: tuple[str, Engine, Engine]) -> None:
    family, warm, cold = engines
    for case in FAMILY_CASES:
        for pair in answer_pairs(warm, cold, case, GREEDY):
            assert 0 < pair.n_cached < pair.n_prompt, (family, pair)
            assert pair.warm_tokens == pair.cold_tokens, (family, pair.case, pair.turn)


@pytest.mark.parametrize("family", SERVED_HYBRID)
def test_a_hybrid_conversation_reuses_its_turns_after_a_restart_and_resumes_before_an_edit(
        family: str, family_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Every later turn reuses the previous turn (the checkpoint at its reply's or prompt's end),
    also from a new engine on the same home; an edit reuses up to the checkpoint before it."""
    model_dir = family_dirs[family]
    warm, cold = _engines(tmp_path, model_dir, family)
    agent = "long"
    history = [ChatMessage("system", LONG_SYSTEM * 3)]
    n_prompts = []
    try:
        for number, user in enumerate(("Hello.", "Name three colors.", "And three animals.", "Which is largest?")):
            if number == 2:  # a restart between turns: everything comes from disk
                warm.stop()
                warm = make_engine_at(tmp_path / "warm", model_dir, [], kv_format="f32", name=family)
            messages = [*history, ChatMessage("user", user)]
            reply, finished = turn(warm, agent, messages, GREEDY)
            if number:
                # At least up to the previous prompt's end; up to its reply's end when the next
                # prompt renders the reply as it was generated (random weights emit whitespace
                # a template strips: then the checkpoint at the prompt's end is the latest).
                assert finished.n_cached_tokens >= n_prompts[-1] - 1, (number, finished.n_cached_tokens)
                assert finished.n_cached_tokens / finished.n_prompt_tokens >= 0.95
                _, cold_finished = turn(cold, None, messages, GREEDY)
                assert finished.output_token_ids == cold_finished.output_token_ids, number
            n_prompts.append(finished.n_prompt_tokens)
            history = [*messages, ChatMessage("assistant", reply)]
        # An edit about 300 tokens before the end of a ~2000-token prompt: the prefill took a
        # checkpoint 512 tokens before its end (and 256): reuse resumes there, not at 0.
        edited = [history[0], ChatMessage("user", "Hello!"), *history[2:-1]]
        _, finished = turn(warm, agent, edited, GREEDY)
        _, cold_finished = turn(cold, None, edited, GREEDY)
        assert finished.output_token_ids == cold_finished.output_token_ids
        assert finished.n_cached_tokens >= 1024, finished.reuse
    finally:
        warm.stop()
        cold.stop()


def test_a_family_that_cannot_be_served_is_refused_by_name(family_dirs: dict[str, Path]) -> None:
    with pytest.raises(InvalidModelFile, match=r"mamba.*ArraysCache \(and no attention layer\)") as refused:
        load_model("mamba", family_dirs["mamba"], kv_format="f32")
    assert "\n" not in str(refused.value)


def test_auto_calibrates_a_hybrid_model_on_its_attention_layers(family_dirs: dict[str, Path],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The ``auto`` KV format's calibration scores formats on the attention layers, the
    recurrent layers keeping their state exact (it used to run every layer as attention).
    Its log lines name the model, not its directory (a Hugging Face view's is a commit hash)."""
    with caplog.at_level(logging.INFO, logger="app.engine.model"):
        loaded = load_model("org/a-hybrid", family_dirs["lfm2"], kv_format="auto")
    assert loaded.kv.chosen_by == "calibration" and loaded.cache_layout.hybrid
    calibration = [r.getMessage() for r in caplog.records if r.name == "app.engine.model"
                   and ("calibrat" in r.getMessage() or "KV format" in r.getMessage())]
    assert any(line.startswith("KV format of org/a-hybrid:") for line in calibration), calibration
    assert all("org/a-hybrid" in line and family_dirs["lfm2"].name not in line for line in calibration), calibration
    assert loaded.n_layers == loaded.cache_layout.n_attention == 2


@pytest.mark.parametrize("family", [*ATTENTION, *SERVED_HYBRID])
def test_the_warm_up_before_serving_runs_on_every_family_and_keeps_nothing(
        family: str, family_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The warm-up an NVIDIA GPU runs before serving (``backend.warmup_chunks``: a prefill
    chunk, a short chunk, a decode step) loads and runs on every served family's cache
    layout, is logged, and leaves the model as it was: a forward pass after another warm-up
    equals one before it."""
    with caplog.at_level(logging.INFO, logger="app.engine.model"):
        loaded = load_model(family, family_dirs[family], kv_format="f32", warmup=(48, 8, 1))
    assert any(r.getMessage().startswith("warmed up for the first requests") and "48, 8, 1 tokens" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # The pass before it, which finds the cache's widths, is timed in the log too (start-up's parts).
    assert any(r.getMessage().startswith("first forward pass (4 tokens") for r in caplog.records)
    layout = loaded.layout

    def logits() -> mx.array:  # a prompt on a fresh cache (no tokens yet: its dtype is the model's)
        cache = layout.assemble(to_working_cache([], layout.n_attention, 0, mx.float32), None)
        out = loaded.model(mx.array([[5, 6, 7, 8, 9, 10]]), cache=cache)
        mx.eval(out)
        return out

    before = logits()
    assert warm_up(loaded.model, (16, 4, 1)) > 0
    assert mx.array_equal(before, logits())
