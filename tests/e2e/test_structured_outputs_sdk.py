"""Structured outputs, seeds and logprobs over HTTP, with the official openai SDK and the Ollama
API against a real server on SmolLM2: what a client sees (the engine-level checks are
tests/integration/test_structured_outputs.py)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from support.servers import ServerProcess

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Name a city and its country."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)


def test_a_json_schema_response_format_gives_schema_valid_json(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=40, temperature=0.7, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_same_seed_gives_the_same_reply_over_http(client: openai.OpenAI) -> None:
    """Twice the same request on an idle server (the second one reusing the first one's cache)."""
    def reply(seed: int) -> str:
        completion = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=16, temperature=1.0,
                                                    seed=seed)
        return completion.choices[0].message.content or ""

    assert reply(77) == reply(77)


def test_logprobs_streamed_spell_the_reply(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 8 and b"".join(bytes(e.bytes) for e in entries).decode() == text
    assert all(e.top_logprobs[0].token == e.token for e in entries)  # greedy: each token is the likeliest


def test_responses_logprobs_spell_the_reply_whole_and_streamed(client: openai.OpenAI) -> None:
    """The Responses API: ``include`` asks for them; whole, the output text's entries spell it;
    streamed, the deltas' entries are the same tokens (greedy: each the likeliest)."""
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.responses.create(model="m", input="Name a city.", max_output_tokens=8, temperature=0, **asked)
    part = whole.output[0].content[0]
    assert whole.usage.output_tokens == len(part.logprobs) > 0
    assert b"".join(bytes(e.bytes) for e in part.logprobs).decode().rstrip() == part.text.rstrip()
    assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in part.logprobs)
    events = list(client.responses.create(model="m", input="Name a city.", max_output_tokens=8, temperature=0,
                                          stream=True, **asked))
    streamed = [e.token for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert streamed == [e.token for e in part.logprobs]


def test_refused_fields_are_a_400_the_sdk_raises(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, frequency_penalty=0.5)
    assert info.value.body["param"] == "frequency_penalty"


def test_ollama_format_json_schema(server: ServerProcess) -> None:
    body = {"model": "m", "stream": False, "format": SCHEMA, "options": {"temperature": 0, "num_predict": 40},
            "messages": QUESTION}
    reply = httpx.post(f"{server.url}/api/chat", json=body, timeout=120).json()
    assert reply["done_reason"] == "stop", reply
    jsonschema.validate(json.loads(reply["message"]["content"]), SCHEMA)


def test_ollama_logprobs_spell_the_streamed_reply(server: ServerProcess) -> None:
    body = {"model": "m", "logprobs": True, "top_logprobs": 2, "options": {"temperature": 0, "num_predict": 8},
            "messages": QUESTION}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=120) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    text = "".join(line["message"]["content"] for line in lines)
    entries = [e for line in lines for e in line.get("logprobs", [])]
    assert len(entries) == lines[-1]["eval_count"] and b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)  # greedy: each token is the likeliest
