"""The admission rule of the batching engine, with plain values."""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.admission import Admission, working_bytes
from app.engine.surface import EngineCounters
from app.types import GenerationRequest, Prompt, SamplingParams


@dataclass(frozen=True)
class Model:
    context_length: int = 100
    kv_bytes_per_token: int = 10


def request(n_prompt: int, max_tokens: int, conversation: str | None = None) -> GenerationRequest:
    return GenerationRequest(f"r-{conversation}", Prompt("x", tuple(range(n_prompt))),
                             SamplingParams(max_tokens=max_tokens), "agent" if conversation else None, conversation)


def test_a_working_cache_holds_the_prompt_and_the_output_within_the_context() -> None:
    assert working_bytes(request(30, 20), Model()) == 500
    assert working_bytes(request(90, 50), Model()) == 1000  # never beyond the context


def test_a_request_that_alone_exceeds_the_budget_is_refused_with_its_numbers() -> None:
    admission = Admission(budget_bytes=4 << 20)
    big = Model(kv_bytes_per_token=1 << 20)
    assert admission.refusal(request(3, 1), big) is None  # 4 MiB: exactly the budget
    refusal = admission.refusal(request(4, 1), big)
    assert refusal is not None and "needs 5 MiB" in refusal and "budget (cache_memory_bytes) is 4 MiB" in refusal


def test_one_always_runs_and_the_others_join_while_they_fit() -> None:
    admission = Admission(budget_bytes=1000, max_batch=8)
    assert admission.can_start(request(90, 50), [], Model(kv_bytes_per_token=50))  # alone, whatever it needs
    running = [request(30, 20, "a")]  # 500 bytes
    assert admission.can_start(request(30, 20, "b"), running, Model())  # 500 + 500
    assert not admission.can_start(request(31, 20, "b"), running, Model())  # 500 + 510


def test_two_turns_of_one_conversation_never_run_together() -> None:
    admission = Admission(budget_bytes=1 << 30)
    assert not admission.can_start(request(1, 1, "a"), [request(1, 1, "a")], Model())
    assert admission.can_start(request(1, 1, None), [request(1, 1, None)], Model())  # no conversation: no cache


def test_the_batch_holds_at_most_max_batch() -> None:
    admission = Admission(budget_bytes=1 << 30, max_batch=2)
    assert admission.can_start(request(1, 1, "c"), [request(1, 1, "a")], Model())
    assert not admission.can_start(request(1, 1, "c"), [request(1, 1, "a"), request(1, 1, "b")], Model())


def test_counters_are_replaced_not_changed() -> None:
    before = EngineCounters()
    after = before.after_decode(2, 0.5, split=True).after_decode(2, 0.25, split=False).after_prefill(32, 1.0)
    assert before == EngineCounters() and not before.steps_by_batch
    assert (after.decode_steps, after.split_steps, after.decode_tokens, after.decode_s) == (2, 1, 4, 0.75)
    assert dict(after.steps_by_batch) == {2: 2} and dict(after.seconds_by_batch) == {2: 0.75}
    assert (after.prefill_tokens, after.prefill_s) == (32, 1.0)


def test_a_draft_models_cache_counts_in_each_generations_working_bytes() -> None:
    assert working_bytes(request(30, 20), Model(), draft_bytes_per_token=4) == 700
    admission = Admission(budget_bytes=1000, max_batch=8, draft_bytes_per_token=4)
    assert admission.refusal(request(30, 20), Model()) is None  # 700
    refusal = admission.refusal(request(50, 30), Model())  # 80 tokens at 14: 1,120 bytes
    assert refusal is not None and "budget (cache_memory_bytes)" in refusal
    assert not admission.can_start(request(30, 20, "b"), [request(30, 20, "a")], Model())  # 700 + 700
    assert Admission(budget_bytes=1000).can_start(request(30, 20, "b"), [request(30, 20, "a")], Model())
