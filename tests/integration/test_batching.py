"""Continuous batching on the real SmolLM2: several agents at once give the answers they get
alone, caches come back committed, and a long cold prefill is interleaved with decoding."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from app.catalog.registry import Catalog
from app.engine.engine import CacheConfig, Engine
from app.engine.scheduler import PrefillPolicy
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams, TextDelta
from support.engines import cache_manager, wait_idle

# Long answers (a list that does not end within max_tokens) and prompts of different lengths,
# about 40, 85, 175 and 300 tokens: the requests overlap whatever the machine's speed. The
# shortest prompt is prefilled first and decodes for 48 steps; while others wait, a prefill
# chunk is sized by time but never under 8 tokens (scheduler.PrefillPolicy), so the next
# prompt (<= 8 * 47 tokens) has joined the decode batch before the first answer ends. (With
# prompts of 400 to 1,500 tokens, a loaded machine's 8-token chunks let every answer end
# before the next prefill did: no step ever decoded two sequences.)
TITLE_TEXT = "Rename the helper, fix the failing test in utils.py and rerun the suite once more. "
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
FILLER = "The committee reviewed the quarterly figures and noted steady progress across every region. "
PROMPTS = {f"agent-{i}": [ChatMessage("system", FILLER * words),
                          ChatMessage("user", f"Question {i}: list twenty colours, one per line.")]
           for i, words in enumerate((1, 4, 10, 18))}


def start_engine(home: Path, model_dir: Path, reuse: bool) -> Engine:
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    cache = CacheConfig(home / "blocks", make_session_factory(make_engine(url)), 1 << 30, enabled=reuse)
    running = Engine(Catalog.single("smollm2", model_dir), cache, max_queue=8, max_batch=8)
    running.start()
    return running


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    running = start_engine(tmp_path_factory.mktemp("batching-home"), smollm2_dir, reuse=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def cold_engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Reuse off: every run computes its prompt from scratch, alone or batched, so the two
    differ by batching only (a warm run would read 4-bit KV where a cold one has floats)."""
    running = start_engine(tmp_path_factory.mktemp("batching-cold"), smollm2_dir, reuse=False)
    yield running
    running.stop()


def request(engine: Engine, agent: str, conversation: str) -> GenerationRequest:
    return GenerationRequest(f"req-{conversation}", engine.render(PROMPTS[agent]), GREEDY, agent, conversation)


def collect(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[str, Finished]]:
    """Submit all at once (they run in one batch), collect each one's text and end."""
    jobs = {r.conversation_id: engine.submit(r) for r in requests}
    results: dict[str, tuple[str, Finished]] = {}

    def read(conversation: str) -> None:
        events = list(jobs[conversation].events())
        results[conversation] = ("".join(e.text for e in events if isinstance(e, TextDelta)), events[-1])

    threads = [threading.Thread(target=read, args=(c,)) for c in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wait_idle(engine)  # the last reply ended before its cache was committed
    return results


def test_batched_greedy_output_equals_solo_output(cold_engine: Engine) -> None:
    engine = cold_engine
    solo = {agent: collect(engine, [request(engine, agent, f"solo-{agent}")])[f"solo-{agent}"] for agent in PROMPTS}
    split_before = engine.status().counters.split_steps
    batched = collect(engine, [request(engine, agent, f"batch-{agent}") for agent in PROMPTS])
    counters = engine.status().counters
    assert max(counters.steps_by_batch) >= 2  # some of them decoded together
    if engine.status().split_cores:  # batched steps were split over both cores (cores.py)
        assert counters.split_steps > split_before
    for agent in PROMPTS:
        text, finished = batched[f"batch-{agent}"]
        assert finished.output_token_ids == solo[agent][1].output_token_ids, agent
        assert text == solo[agent][0]


def test_every_batched_conversation_commits_its_whole_cache(engine: Engine) -> None:
    batched = collect(engine, [request(engine, agent, f"batch-{agent}") for agent in PROMPTS])
    for agent in PROMPTS:
        record = cache_manager(engine).record(f"batch-{agent}")
        finished = batched[f"batch-{agent}"][1]
        assert record is not None and record.n_tokens == finished.n_prompt_tokens + finished.n_output_tokens


def test_a_second_turn_in_a_batch_continues_its_cache(engine: Engine) -> None:
    """Turn 2 of every agent at once: each extends its own conversation's cache (warm)."""
    first = collect(engine, [request(engine, agent, f"t-{agent}") for agent in PROMPTS])
    follow_ups = []
    for agent in PROMPTS:
        reply = first[f"t-{agent}"][0]
        messages = [*PROMPTS[agent], ChatMessage("assistant", reply), ChatMessage("user", "And another one?")]
        follow_ups.append(GenerationRequest(f"req-t2-{agent}", engine.render(messages), GREEDY, agent, f"t-{agent}"))
    second = collect(engine, follow_ups)
    for agent in PROMPTS:
        finished = second[f"t-{agent}"][1]
        assert finished.reuse.reason == "extend"
        assert finished.n_cached_tokens >= first[f"t-{agent}"][1].n_prompt_tokens


def test_prefill_only_jobs_and_generations_share_the_engine(engine: Engine) -> None:
    prefill_only = GenerationRequest("req-prefill", engine.render(PROMPTS["agent-3"]),
                                     SamplingParams(max_tokens=0), "agent-3", "prefilled")
    results = collect(engine, [prefill_only, request(engine, "agent-0", "beside-prefill")])
    assert results["prefilled"][1].n_output_tokens == 0 and results["prefilled"][0] == ""
    record = cache_manager(engine).record("prefilled")
    assert record is not None and record.n_tokens == results["prefilled"][1].n_prompt_tokens
    assert results["beside-prefill"][1].n_output_tokens > 0


def test_two_turns_of_one_conversation_are_serialized(engine: Engine) -> None:
    """Submitted together, the second turn of a conversation waits for the first to commit,
    then reads its cache (never the same cache at the same time): its whole prompt but the
    last token comes from the first turn's stored cache, which exists only after that commit.
    (The order in which two reader threads see their events says nothing: they race.)"""
    first, second = (GenerationRequest(f"req-same-{i}", engine.render(PROMPTS["agent-2"]), GREEDY, "agent-2",
                                       "same-conversation") for i in range(2))
    jobs = {"first": engine.submit(first), "second": engine.submit(second)}
    finals: dict[str, Finished] = {}

    def read(name: str) -> None:
        for event in jobs[name].events():
            if isinstance(event, Finished):
                finals[name] = event

    threads = [threading.Thread(target=read, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    n_prompt = finals["second"].n_prompt_tokens
    assert finals["second"].n_cached_tokens == n_prompt - 1  # the whole prompt but its last token, from the first


def test_a_short_prompt_behind_a_long_prefill_takes_whole_chunks(engine: Engine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A title request that arrives during a long cold prefill goes first (shortest first), in
    the chunks it would take alone (a full step first): the long prompt paused behind it is no
    reason for chunks sized to a quarter second, whose fixed cost per forward pass held Claude
    Code's 393-token title for 145 s behind a 9K-token prefill on the 1.5B. (A spy on the real
    prefill: it still runs.)"""
    import app.engine.runner as runner_module

    calls: list[tuple[int, int]] = []  # (the cache's id, tokens in the chunk)
    real_prefill = runner_module.prefill

    def spy(model: object, cache: list[object], tokens: object) -> None:
        calls.append((id(cache), len(tokens)))  # type: ignore[arg-type]
        real_prefill(model, cache, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "prefill", spy)
    long = GenerationRequest("req-long-prefill", engine.render([ChatMessage("user", FILLER * 160)]),
                             SamplingParams(max_tokens=0), "agent-long", "long-prefill")
    short = GenerationRequest("req-title", engine.render([ChatMessage("user", TITLE_TEXT * 17 + "A title, please.")]),
                              SamplingParams(temperature=0.0, max_tokens=4), "agent-title", "title")
    long_job = engine.submit(long)
    deadline = time.monotonic() + 60
    while not calls and time.monotonic() < deadline:  # the long prefill runs
        time.sleep(0.01)
    short_job = engine.submit(short)
    for job in (short_job, long_job):
        assert isinstance(list(job.events())[-1], Finished)
    assert wait_idle(engine)
    long_cache = calls[0][0]
    first_short = next(i for i, (cache, _) in enumerate(calls) if cache != long_cache)
    short_chunks = [n for cache, n in calls[first_short:] if cache != long_cache]
    assert all(cache != long_cache for cache, _ in calls[first_short:first_short + len(short_chunks)])  # in a row
    policy = PrefillPolicy()
    assert short_chunks[0] == policy.step_tokens, short_chunks  # its speed unknown: a full step, not 32
    assert all(n >= policy.alone_min_tokens for n in short_chunks[:-1]), short_chunks  # sized as alone
