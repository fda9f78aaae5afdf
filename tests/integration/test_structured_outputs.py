"""Structured outputs, seeds and log-probabilities on the real SmolLM2 (the engine, requests
parsed by the real protocols).

A JSON-schema request's reply parses and validates against the schema, greedy and sampled,
alone and in a batch beside a request without one (whose reply stays prose); the same
prompt without the grammar does not give valid JSON, so the grammar is what holds it. A
forced tool call's arguments validate against the tool's schema. The same seed draws the
same reply; each token's log-probability is the one it was chosen with (greedy: the top one).
The engine speculates by default here: a constrained, seeded or logprobs sequence must not.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest

from app.engine.engine import Engine
from app.protocol import anthropic, openai
from app.protocol.turn import ParsedTurn
from app.types import Finished, GenerationRequest, RequestOptions, SamplingParams, TextDelta
from support.engines import loaded_model, make_engine_at

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person: their name, their age and their pets."}]


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    running = make_engine_at(tmp_path_factory.mktemp("structured-home"), smollm2_dir, [], enabled=False)
    yield running
    running.stop()


def chat(**fields: Any) -> ParsedTurn:
    return openai.parse_request({"model": "m", "messages": ASK, "max_tokens": 48, **fields}, RequestOptions())


def run(engine: Engine, parsed: ParsedTurn, sampling: SamplingParams | None = None) -> tuple[str, Finished]:
    prompt = engine.render(parsed.messages, parsed.reply_prefix, prefill=parsed.prefill)
    job = engine.submit(GenerationRequest("req-structured", prompt, sampling or parsed.sampling))
    events = list(job.events())
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
def test_a_json_schema_reply_validates_greedy_and_sampled(engine: Engine, temperature: float, seed: int) -> None:
    text, finished = run(engine, chat(response_format=JSON_SCHEMA, temperature=temperature, seed=seed))
    assert finished.stop_reason == "end_turn", text  # the grammar closed the object, then only a stop token
    assert valid(text, SCHEMA), text
    assert finished.n_draft_tokens == 0


def test_without_the_grammar_the_same_prompt_gives_no_valid_json(engine: Engine) -> None:
    parsed = chat(response_format=JSON_SCHEMA, temperature=0.0)
    assert parsed.sampling.constraint is not None
    text, _ = run(engine, parsed, replace(parsed.sampling, constraint=None))
    assert not valid(text, SCHEMA), text


def test_json_mode_gives_an_object(engine: Engine) -> None:
    parsed = openai.parse_request({"model": "m", "max_tokens": 24, "temperature": 0, "response_format": {
        "type": "json_object"}, "messages": [{"role": "user", "content": "Give the capital of France as JSON."}]},
                                  RequestOptions())
    text, finished = run(engine, parsed)
    assert finished.stop_reason == "end_turn" and isinstance(json.loads(text), dict), text


def test_in_a_batch_each_sequence_keeps_its_own_grammar(engine: Engine) -> None:
    results: dict[str, str] = {}

    def one(key: str, parsed: ParsedTurn) -> None:
        results[key] = run(engine, parsed)[0]

    threads = [threading.Thread(target=one, args=("json", chat(response_format=JSON_SCHEMA, temperature=0.0))),
               threading.Thread(target=one, args=("prose", chat(temperature=0.0)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert valid(results["json"], SCHEMA), results["json"]
    assert not results["prose"].lstrip().startswith("{"), results["prose"]


def test_a_forced_tool_call_holds_to_the_tools_input_schema(engine: Engine) -> None:
    tool = {"name": "book", "description": "Book a table.", "input_schema": {
        "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12},
                                         "day": {"enum": ["friday", "saturday"]}},
        "required": ["guests", "day"], "additionalProperties": False}}
    parsed = anthropic.parse_request({"model": "m", "max_tokens": 40, "temperature": 0, "tools": [tool],
                                      "tool_choice": {"type": "tool", "name": "book"},
                                      "messages": [{"role": "user", "content": "A table for four."}]},
                                     RequestOptions())
    assert parsed.sampling.constraint is not None
    text, finished = run(engine, parsed)
    calls = [part for part in anthropic.parse_reply(parsed, text) if not isinstance(part, str)]
    assert len(calls) == 1 and calls[0].name == "book", text
    jsonschema.validate(calls[0].arguments, tool["input_schema"])


def test_the_same_seed_draws_the_same_reply(engine: Engine) -> None:
    first = run(engine, chat(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16))[0]
    assert run(engine, chat(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16))[0] == first
    assert run(engine, chat(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16))[0] != first


def test_each_tokens_logprob_is_the_one_it_was_chosen_with(engine: Engine) -> None:
    text, finished = run(engine, chat(temperature=0.0, max_tokens=12, logprobs=True, top_logprobs=3))
    entries = finished.logprobs
    assert len(entries) == finished.n_output_tokens - (finished.stop_reason == "end_turn")
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.top[0].bytes == entry.bytes and entry.top[0].logprob == pytest.approx(entry.logprob)
        assert entry.top[0].logprob >= entry.top[1].logprob >= entry.top[2].logprob
    assert finished.n_draft_tokens == 0


def test_an_object_schema_that_says_nothing_of_other_keys_is_held_closed(engine: Engine) -> None:
    """As llama.cpp and Ollama hold it: a schema listing ``properties`` without
    ``additionalProperties`` allows no other key (open, a small model adds keys until its
    limit); ``additionalProperties: true`` opens it, nested objects are closed too."""
    from app.engine.grammar import matcher_for, tokenizer_for
    from app.protocol.structured import response_format

    spec = loaded_model(engine)
    tokenizer = tokenizer_for(spec)
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "at": point}, "required": ["name", "at"]}

    def accepts(schema: dict[str, Any], text: str) -> bool:
        matcher = matcher_for(response_format(schema, "response_format"), spec)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()

    assert accepts(schema, '{"name": "a", "at": {"x": 1}}')
    assert not accepts(schema, '{"name": "a", "at": {"x": 1}, "extra": 2}')
    assert not accepts(schema, '{"name": "a", "at": {"x": 1, "y": 2}}')
    opened = {**schema, "additionalProperties": True}
    assert accepts(opened, '{"name": "a", "at": {"x": 1}, "extra": 2}')
    assert not accepts(opened, '{"name": "a", "at": {"x": 1, "y": 2}}')  # its nested object still closed
