"""The engine on the real SmolLM2: events, sampling limits, stop sequences, cancel."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator

import pytest

from app.catalog.registry import Catalog
from app.engine.engine import CacheConfig, Engine
from app.store.db import make_engine, make_session_factory, upgrade
from app.errors import ContextTooLong
from app.types import ChatMessage, Finished, GenerationRequest, Prompt, SamplingParams, Started, TextDelta
from support.engines import loaded_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
QUESTION = (ChatMessage("user", "List five fruits, one per line."),)


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    home = tmp_path_factory.mktemp("engine-home")
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    cache = CacheConfig(home / "blocks", make_session_factory(make_engine(url)), 1 << 30, enabled=False)
    running = Engine(Catalog.single("smollm2", smollm2_dir), cache, max_queue=4)
    running.start()
    yield running
    running.stop()


def run(engine: Engine, sampling: SamplingParams, prompt: Prompt | None = None) -> tuple[list, str, Finished]:
    job = engine.submit(GenerationRequest("req_test", prompt or engine.render(QUESTION), sampling))
    events = list(job.events())
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert isinstance(events[-1], Finished)
    return events, text, events[-1]


def test_events_start_stream_and_finish(engine: Engine) -> None:
    events, text, finished = run(engine, GREEDY)
    prompt = engine.render(QUESTION)
    # The lease's report comes before prefill (the x-semantic-cache header of a stream), the
    # same as at the end: no agent, no reuse.
    assert events[0] == Started(prompt.n_tokens, 0, 0, finished.reuse)
    assert finished.reuse is not None and (finished.reuse.source, finished.reuse.reason) == ("none", "off")
    assert sum(isinstance(e, TextDelta) for e in events) > 3
    assert text.strip()
    assert finished.n_prompt_tokens == prompt.n_tokens
    assert 0 < finished.n_output_tokens <= GREEDY.max_tokens
    assert finished.stop_reason in ("end_turn", "max_tokens")
    assert 0 < finished.ttft_s <= finished.total_s


def test_time_to_first_token_counts_from_the_requests_arrival_in_parts(engine: Engine) -> None:
    """A request that arrived (over HTTP) 0.5 s before it was submitted waited those 0.5 s:
    they are queue time, and the parts add up to the time to first token."""
    arrived = time.perf_counter() - 0.5
    job = engine.submit(GenerationRequest("req_arrived", engine.render(QUESTION),
                                          SamplingParams(temperature=0.0, max_tokens=4), arrived_at=arrived))
    finished = [e for e in job.events() if isinstance(e, Finished)][0]
    waited = time.perf_counter() - arrived
    assert finished.queue_s >= 0.5 and finished.restore_s >= 0 and finished.prefill_s > 0
    assert finished.ttft_s == pytest.approx(finished.queue_s + finished.restore_s + finished.prefill_s)
    assert 0.5 < finished.ttft_s <= finished.total_s <= waited


def test_greedy_is_deterministic(engine: Engine) -> None:
    assert run(engine, GREEDY)[1] == run(engine, GREEDY)[1]


def test_max_tokens_stops_exactly(engine: Engine) -> None:
    _, _, finished = run(engine, SamplingParams(temperature=0.0, max_tokens=3))
    assert (finished.stop_reason, finished.n_output_tokens) == ("max_tokens", 3)


def test_stop_sequence_truncates_before_it(engine: Engine) -> None:
    _, full, _ = run(engine, GREEDY)
    stop = full.strip().split("\n")[1][:3]  # a stop string from the middle of the reply
    _, text, finished = run(engine, SamplingParams(temperature=0.0, max_tokens=48, stop_sequences=(stop,)))
    assert finished.stop_reason == "stop_sequence" and finished.stop_sequence == stop
    assert text == full[: full.index(stop)]


def test_end_of_turn_token_ends_generation(engine: Engine) -> None:
    prompt = engine.render((ChatMessage("user", "What is the capital of France?"),))
    _, text, finished = run(engine, SamplingParams(temperature=0.0, max_tokens=64), prompt)
    assert finished.stop_reason == "end_turn"
    assert "Paris" in text and "<|im_end|>" not in text


def test_prompt_longer_than_context_is_refused(engine: Engine) -> None:
    long_prompt = Prompt("x", tuple([42] * loaded_model(engine).context_length))
    with pytest.raises(ContextTooLong, match=r"prompt is too long: 8192 tokens > 8191 maximum"):
        engine.submit(GenerationRequest("req_long", long_prompt, GREEDY))


def test_cancel_stops_generation(engine: Engine) -> None:
    job = engine.submit(GenerationRequest("req_cancel", engine.render(QUESTION),
                                          SamplingParams(temperature=0.0, max_tokens=200)))
    events = job.events()
    for event in events:
        if isinstance(event, TextDelta):
            job.cancel()
            break
    finished = [e for e in events if isinstance(e, Finished)][0]
    assert finished.stop_reason == "cancelled" and finished.n_output_tokens < 200


def test_a_long_prefill_logs_its_progress_by_quarters(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A prompt of 4 prefill chunks or more says how far it is at 25, 50 and 75 percent (a
    client may wait minutes on a CPU with nothing to show)."""
    long = [ChatMessage("user", "Summarize these notes: " + "the meeting moved to Tuesday at noon; " * 150)]
    prompt = engine.render(long)
    assert prompt.n_tokens > 4 * 256
    with caplog.at_level(logging.INFO, logger="app.engine.runner"):
        run(engine, SamplingParams(temperature=0.0, max_tokens=1), prompt)
    lines = [r.getMessage() for r in caplog.records if "prefill" in r.getMessage() and "% (" in r.getMessage()]
    percents = [int(line.split("prefill ")[1].split("%")[0]) for line in lines]
    assert len(percents) == 3 and 25 <= percents[0] < 50 <= percents[1] < 75 <= percents[2] < 100, lines
    assert all(f"of {prompt.n_tokens} new tokens" in line for line in lines), lines


def test_a_start_runs_the_model_once_its_head_dims_probe_being_the_warm_up(
        smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Boot time (benchmarks/boot.py): ``load_model``'s head-dims probe is a forward pass of a
    few tokens, which warms the kernels up; the engine thread runs no second one before ready."""
    from mlx_lm.models import llama

    passes: list[int] = []
    forward = llama.Model.__call__
    monkeypatch.setattr(llama.Model, "__call__", lambda self, inputs, *a, **k: (
        passes.append(inputs.shape[-1]), forward(self, inputs, *a, **k))[1])
    url = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(url)
    started = Engine(Catalog.single("smollm2", smollm2_dir),
                     CacheConfig(tmp_path / "blocks", make_session_factory(make_engine(url)), 1 << 30, enabled=False))
    started.start()
    try:
        assert passes == [4]
        _, text, _ = run(started, SamplingParams(temperature=0.0, max_tokens=4))
        assert text and len(passes) > 1
    finally:
        started.stop()


def test_the_tokenizer_side_loads_beside_the_weights_and_a_directory_that_is_no_model_says_so(
        smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Boot time: ``load_spec`` (tokenizer, token bytes, fingerprint: Python) runs on a thread of
    its own while the caller reads the weights (MLX, without the GIL); its errors still win."""
    import threading

    from app.engine import model as model_module
    from app.errors import InvalidModelFile

    threads: list[str] = []
    spec = model_module.load_spec
    monkeypatch.setattr(model_module, "load_spec", lambda *args: (
        threads.append(threading.current_thread().name), spec(*args))[1])
    loaded = model_module.load_model("smollm2", smollm2_dir)
    assert loaded.fingerprint == spec("smollm2", smollm2_dir).fingerprint
    assert len(threads) == 1 and threads[0] != threading.current_thread().name
    with pytest.raises(InvalidModelFile, match="not a model directory"):
        model_module.load_model("none", tmp_path)
