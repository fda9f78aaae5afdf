"""Structured outputs, seeds and log-probabilities through every API, against the fake engine:
what reaches the engine (``SamplingParams``: the grammar, the seed, logprobs), what the prompt
says of the format, how logprobs come back (OpenAI chat, whole and streamed), and the fields
that would change the answer and cannot be honoured: a 400 in the protocol's own shape naming
the field, nothing submitted. Fields that change nothing stay accepted.

The grammars themselves are held by the real engine on the real model:
tests/integration/test_structured_outputs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.dbcheck import query
from support.grammar_check import allows as _allows
from support.fake_engine import make_app


@pytest.fixture
def app(tmp_path: Path):  # type: ignore[no-untyped-def]
    return make_app(tmp_path)


CHAT = {"model": "gpt-x", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}
MESSAGES = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}
RESPONSES = {"model": "gpt-x", "input": "Say hi."}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": SCHEMA}}
CLAUDE_WEATHER = {"name": "weather", "description": "The weather in a city.", "input_schema": SCHEMA}


def test_openai_response_format_reaches_the_engine_as_a_grammar_and_the_prompt_names_it(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    body = {**CHAT, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "where", "schema": SCHEMA, "strict": True}}}
    assert client.simulate_post("/v1/chat/completions", json=body).status_code == 200
    submitted = engine.submitted[-1]
    constraint = submitted.sampling.constraint
    assert constraint is not None and constraint.prefix == "" and not submitted.sampling.may_draft
    assert _allows(constraint.grammar, '{"city": "Paris"}')
    assert not _allows(constraint.grammar, '{"town": "Paris"}') and not _allows(constraint.grammar, "Paris")
    assert json.dumps(SCHEMA) in submitted.prompt.text  # the schema, written as the client sent it
    assert client.simulate_post("/v1/chat/completions", json=body).status_code == 200
    assert engine.submitted[-1].prompt.text == submitted.prompt.text  # deterministically
    assert client.simulate_post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}}
                                ).status_code == 200
    any_object = engine.submitted[-1].sampling.constraint
    assert any_object is not None and _allows(any_object.grammar, '{"a": [1, 2]}')
    assert not _allows(any_object.grammar, "[1, 2]")
    assert client.simulate_post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}
                                ).status_code == 200
    assert engine.submitted[-1].sampling.constraint is None and engine.submitted[-1].sampling.may_draft


def test_openai_response_format_with_tools_allows_the_json_or_one_call(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    body = {**CHAT, "tools": [WEATHER], "response_format": {"type": "json_object"}}
    assert client.simulate_post("/v1/chat/completions", json=body).status_code == 200
    grammar = engine.submitted[-1].sampling.constraint.grammar
    assert _allows(grammar, '{"answer": 1}')
    assert _allows(grammar, '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _allows(grammar, '<tool_call>\n{"name": "weather", "arguments": {"town": "Oslo"}}\n</tool_call>')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_an_openai_forced_call_is_held_to_the_tools_schema(app, choice: Any) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    assert client.simulate_post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": choice}
                                ).status_code == 200
    constraint = engine.submitted[-1].sampling.constraint
    assert constraint is not None and engine.submitted[-1].prompt.text.endswith(constraint.prefix)
    assert _allows(constraint.grammar, '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _allows(constraint.grammar, '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>')


def test_openai_seed_and_logprobs_reach_the_engine(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    client.simulate_post("/v1/chat/completions", json={**CHAT, "seed": 7, "temperature": 0.9})
    assert (engine.submitted[-1].sampling.seed, engine.submitted[-1].sampling.logprobs) == (7, None)
    assert not engine.submitted[-1].sampling.may_draft
    client.simulate_post("/v1/chat/completions", json={**CHAT, "top_k": 40})
    assert engine.submitted[-1].sampling.top_k == 40
    client.simulate_post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert engine.submitted[-1].sampling.logprobs == 0
    client.simulate_post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3})
    assert engine.submitted[-1].sampling.logprobs == 3


def test_openai_logprobs_come_back_whole_and_streamed(app) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = app
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    whole = client.simulate_post("/v1/chat/completions", json=body).json["choices"][0]
    content = whole["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " there", "."]
    assert content[0] == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
        {"token": "Hello1", "logprob": -1.5, "bytes": list(b"Hello1")}]}
    assert client.simulate_post("/v1/chat/completions", json=CHAT).json["choices"][0]["logprobs"] is None
    stream = client.simulate_post("/v1/chat/completions", json={**body, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    streamed = [c for chunk in chunks for choice in chunk["choices"] if choice.get("logprobs")
                for c in choice["logprobs"]["content"]]
    assert streamed == content


def test_responses_logprobs_come_back_whole_and_streamed(app) -> None:  # type: ignore[no-untyped-def]
    """``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) puts each token's
    entry on the output_text part, whole; streamed, on the deltas (every token once, in order)
    and on the part's done event; not asked, the lists are empty and nothing is computed."""
    client, engine, _ = app
    body = {**RESPONSES, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.simulate_post("/v1/responses", json=body)
    assert whole.status_code == 200, whole.text
    assert engine.submitted[-1].sampling.logprobs == 2
    (part,) = whole.json["output"][0]["content"]
    assert [e["token"] for e in part["logprobs"]] == ["Hello", " there", "."]
    assert part["logprobs"][0] == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
        {"token": "Hello1", "logprob": -1.5, "bytes": list(b"Hello1")}]}
    plain = client.simulate_post("/v1/responses", json=RESPONSES)
    assert plain.json["output"][0]["content"][0]["logprobs"] == [] and engine.submitted[-1].sampling.logprobs is None
    stream = client.simulate_post("/v1/responses", json={**body, "stream": True}).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    deltas = [e for event in events if event["type"] == "response.output_text.delta" for e in event["logprobs"]]
    assert deltas == part["logprobs"]
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    assert done["logprobs"] == part["logprobs"]


def test_anthropic_output_format_forced_calls_and_what_claude_code_sends(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    for extra in ({"output_format": {"type": "json_schema", "schema": SCHEMA}},
                  {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"}}):
        assert client.simulate_post("/v1/messages", json={**MESSAGES, **extra}).status_code == 200
        constraint = engine.submitted[-1].sampling.constraint
        assert constraint is not None and _allows(constraint.grammar, '{"city": "Rome"}')
        assert json.dumps(SCHEMA) in engine.submitted[-1].prompt.text
    prefilled = {**MESSAGES, "output_format": {"type": "json_schema", "schema": SCHEMA},
                 "messages": [*MESSAGES["messages"], {"role": "assistant", "content": '{"city":'}]}
    assert client.simulate_post("/v1/messages", json=prefilled).status_code == 200
    assert engine.submitted[-1].sampling.constraint.prefix == '{"city":'
    forced = {**MESSAGES, "tools": [CLAUDE_WEATHER], "tool_choice": {"type": "tool", "name": "weather"}}
    assert client.simulate_post("/v1/messages", json=forced).status_code == 200
    constraint = engine.submitted[-1].sampling.constraint
    assert constraint is not None and engine.submitted[-1].prompt.text.endswith(constraint.prefix)
    assert not _allows(constraint.grammar, '<tool_call>\n{"name": "weather", "arguments": {"x": 1}}\n</tool_call>')
    claude_code = {**MESSAGES, "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                   "output_config": {"effort": "high"}, "metadata": {"user_id": "u"}, "service_tier": "auto"}
    assert client.simulate_post("/v1/messages", json=claude_code).status_code == 200
    assert engine.submitted[-1].sampling.constraint is None


def test_responses_text_format_and_the_direct_api_output_format(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    body = {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "where", "schema": SCHEMA,
                                             "strict": True}, "verbosity": "medium"}}
    response = client.simulate_post("/v1/responses", json=body)
    assert response.status_code == 200 and response.json["text"]["format"]["type"] == "json_schema"
    assert _allows(engine.submitted[-1].sampling.constraint.grammar, '{"city": "Lima"}')
    assert json.dumps(SCHEMA) in engine.submitted[-1].prompt.text
    client.simulate_post("/v1/responses", json={**RESPONSES, "text": {"format": {"type": "json_object"}}})
    assert _allows(engine.submitted[-1].sampling.constraint.grammar, "{}")
    client.simulate_post("/v1/agents", json={"id": "d1", "prefill": False})
    direct = {"messages": [{"role": "user", "content": "Hi"}], "output_format": {"type": "json_schema",
                                                                                  "schema": SCHEMA}}
    assert client.simulate_post("/v1/agents/d1/generate", json=direct).status_code == 200
    assert engine.submitted[-1].sampling.constraint is not None


REFUSED = [
    ("/v1/chat/completions", CHAT, {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/chat/completions", CHAT, {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", CHAT, {"presence_penalty": -1.0}, "presence_penalty"),
    ("/v1/chat/completions", CHAT, {"min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", CHAT, {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/chat/completions", CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", CHAT, {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", CHAT, {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", CHAT, {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", CHAT, {"n": 2}, "n"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "response_format.json_schema.schema"),
    # A node that requires a child node: no finite JSON fits (it was a 200 holding `{"`, issue 59 item 7).
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "tree", "schema": {"$defs": {"node": {"type": "object", "properties": {"child": {
            "$ref": "#/$defs/node"}}, "required": ["child"]}}, "$ref": "#/$defs/node"}}}},
     "response_format.json_schema.schema"),
    ("/v1/messages", MESSAGES, {"output_format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}}}, "output_format.schema"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("/v1/messages", MESSAGES, {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    ("/v1/messages", MESSAGES, {"container": "c_1"}, "container"),
    ("/v1/messages", MESSAGES, {"output_format": {"type": "json_schema", "schema": {"type": "strin"}}},
     "output_format.schema"),
    ("/v1/messages", MESSAGES, {"output_format": {"type": "xml"}}, "output_format.type"),
    ("/v1/responses", RESPONSES, {"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ("/v1/responses", RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
     "text.format.schema"),
    ("/v1/responses", RESPONSES, {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", RESPONSES, {"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ("/v1/responses", RESPONSES, {"include": ["message.output_text.logprobs"], "tools": [
        {"type": "function", "name": "weather", "parameters": SCHEMA}]}, "include"),
    ("/v1/responses", RESPONSES, {"include": ["message.output_text.logprobs"], "reasoning": {"effort": "low"}},
     "include"),
]


@pytest.mark.parametrize("path, base, extra, field", REFUSED)
def test_what_would_change_the_answer_and_cannot_be_honoured_is_a_400_naming_it(
        app, path: str, base: dict[str, Any], extra: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    response = client.simulate_post(path, json={**base, **extra})
    assert response.status_code == 400, response.text
    error = response.json["error"]
    assert error["message"].startswith(f"{field}:"), error
    assert error["type"] == "invalid_request_error"
    if path != "/v1/messages":
        assert error["param"] == field
    assert engine.submitted == []
    assert [status for (status,) in query(db, "SELECT status FROM requests")] == ["rejected"]


def test_fields_that_change_nothing_are_accepted(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    neutral = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": False,
               "stream_options": {"include_usage": True}, "service_tier": "auto", "logit_bias": {},
               "frequency_penalty": 0, "presence_penalty": 0.0, "modalities": ["text"], "function_call": "auto",
               "prediction": {"type": "content", "content": "Hi"}, "prompt_cache_key": "k", "logprobs": False,
               "seed": None, "response_format": None, "safety_identifier": "s", "repetition_penalty": 1.0}
    response = client.simulate_post("/v1/chat/completions", json={**CHAT, **neutral})
    assert response.status_code == 200, response.text
    sampling = engine.submitted[-1].sampling
    assert (sampling.constraint, sampling.seed, sampling.logprobs, sampling.may_draft) == (None, None, None, True)
