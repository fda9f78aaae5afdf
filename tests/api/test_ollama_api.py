"""The Ollama API against the fake engine: request and response shapes, NDJSON streams,
options mapped to sampling or refused by name, errors in Ollama's shape, and every turn
recorded (protocol "ollama") with its history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.protocol import ollama
from app.types import RequestOptions
from support.dbcheck import query
from support.fake_engine import make_app


@pytest.fixture
def app(tmp_path: Path):  # type: ignore[no-untyped-def]
    return make_app(tmp_path)


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hi."}]}
GENERATE = {"model": "fake", "prompt": "Say hi.", "system": "Be brief."}
STATS = {"total_duration": 20_000_000, "load_duration": 3_000_000, "prompt_eval_duration": 5_000_000,
         "eval_duration": 10_000_000, "eval_count": 3}  # the fake job's seconds, in nanoseconds


def lines(text: str) -> list[dict[str, Any]]:
    """An NDJSON body: one JSON object a line, each line ended."""
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_chat_turn_answers_in_ollamas_shape_and_is_recorded(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    response = client.simulate_post("/api/chat", json={**CHAT, "stream": False, "session_id": "ol-1"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    body = response.json
    assert body["model"] == "fake" and body["created_at"].endswith("Z")
    assert body["message"] == {"role": "assistant", "content": "Hello there."}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert {k: body[k] for k in STATS} == STATS and body["prompt_eval_count"] >= 1
    assert engine.submitted[-1].agent_id == "ol-1"
    assert query(db, "SELECT origin FROM agents WHERE id = 'ol-1'") == [("ollama",)]
    assert query(db, "SELECT protocol, status FROM requests WHERE agent_id = 'ol-1'") == [("ollama", "ok")]
    assert query(db, "SELECT role FROM messages WHERE agent_id = 'ol-1' ORDER BY position") == [("user",),
                                                                                                ("assistant",)]


def test_the_x_session_id_header_names_the_agent(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    assert client.simulate_post("/api/chat", json={**CHAT, "stream": False},
                                headers={"X-Session-ID": "ol-header"}).status_code == 200
    assert engine.submitted[-1].agent_id == "ol-header"


def test_chat_streams_ndjson_by_default(app) -> None:  # type: ignore[no-untyped-def]
    client, _, db = app
    response = client.simulate_post("/api/chat", json={**CHAT, "session_id": "ol-stream"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    objects = lines(response.text)
    *chunks, last = objects
    assert chunks and all(c["done"] is False and c["message"]["role"] == "assistant" for c in chunks)
    assert "".join(c["message"]["content"] for c in chunks) == "Hello there."
    assert last["done"] is True and last["done_reason"] == "stop" and last["message"]["content"] == ""
    assert {k: last[k] for k in STATS} == STATS
    assert query(db, "SELECT protocol, stream FROM requests WHERE agent_id = 'ol-stream'") == [("ollama", 1)]


def test_generate_answers_response_text_streamed_and_not(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    whole = client.simulate_post("/api/generate", json={**GENERATE, "stream": False})
    assert whole.status_code == 200 and whole.json["response"] == "Hello there." and whole.json["done"] is True
    assert "context" not in whole.json
    assert engine.submitted[-1].prompt.text == "<system>Be brief.<user>Say hi.<assistant>"
    *chunks, last = lines(client.simulate_post("/api/generate", json=GENERATE).text)
    assert "".join(c["response"] for c in chunks) == "Hello there." and last["response"] == ""
    assert last["done"] is True and {k: last[k] for k in STATS} == STATS
    assert query(db, "SELECT count(*) FROM requests WHERE protocol = 'ollama' AND status = 'ok'") == [(2,)]


def test_options_map_to_sampling(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    options = {"temperature": 0, "top_p": 0.5, "top_k": 7, "num_predict": 9, "stop": ["\n\n"], "seed": 42,
               "num_ctx": 8192, "num_thread": 2, "repeat_penalty": 1.0}
    assert client.simulate_post("/api/chat", json={**CHAT, "stream": False, "options": options}).status_code == 200
    sampling = engine.submitted[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens,
            sampling.stop_sequences, sampling.seed) == (0, 0.5, 7, 9, ("\n\n",), 42)
    client.simulate_post("/api/generate", json={**GENERATE, "stream": False, "options": {"num_predict": -1}})
    assert engine.submitted[-1].sampling.max_tokens == RequestOptions().max_output_tokens
    client.simulate_post("/api/chat", json={**CHAT, "stream": False, "options": {"seed": 7, "temperature": 0.8}})
    assert (engine.submitted[-1].sampling.seed, engine.submitted[-1].sampling.temperature) == (7, 0.8)


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_format_holds_the_reply_to_json_and_says_so_in_the_prompt(app, path: str) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    body = CHAT if path == "/api/chat" else GENERATE
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for fmt, instruction in (("json", "Answer with a JSON object only."), (schema, '"required": ["city"]')):
        assert client.simulate_post(path, json={**body, "stream": False, "format": fmt}).status_code == 200
        submitted = engine.submitted[-1]
        assert submitted.sampling.constraint is not None and submitted.sampling.constraint.what != ""
        assert instruction in submitted.prompt.text
    assert client.simulate_post(path, json={**body, "stream": False, "format": ""}).status_code == 200
    assert engine.submitted[-1].sampling.constraint is None


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_logprobs_come_back_whole_and_on_each_streamed_line(app, path: str) -> None:  # type: ignore[no-untyped-def]
    """Ollama's ``logprobs`` / ``top_logprobs``: every output token's entry (token, logprob,
    bytes, its alternatives), on the answer, or on the lines that carry its text."""
    client, engine, _ = app
    body = {**(CHAT if path == "/api/chat" else GENERATE), "logprobs": True, "top_logprobs": 2}
    whole = client.simulate_post(path, json={**body, "stream": False}).json
    assert engine.submitted[-1].sampling.logprobs == 2
    assert [e["token"] for e in whole["logprobs"]] == ["Hello", " there", "."]
    assert whole["logprobs"][0] == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
        {"token": "Hello1", "logprob": -1.5, "bytes": list(b"Hello1")}]}
    lines = [json.loads(line) for line in client.simulate_post(path, json=body).text.splitlines() if line]
    assert [e for line in lines for e in line.get("logprobs", [])] == whole["logprobs"]
    plain = client.simulate_post(path, json={**body, "logprobs": False, "top_logprobs": 0, "stream": False}).json
    assert "logprobs" not in plain and engine.submitted[-1].sampling.logprobs is None


@pytest.mark.parametrize("path,extra,field", [
    ("/api/chat", {"options": {"repeat_penalty": 1.1}}, "options.repeat_penalty"),
    ("/api/chat", {"options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"options": {"no_such_option": 1}}, "options.no_such_option"),
    ("/api/chat", {"options": {"seed": "1"}}, "options.seed"),
    ("/api/chat", {"options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"options": {"temperature": 5}}, "temperature"),
    ("/api/chat", {"format": "yaml"}, "format"),
    ("/api/chat", {"format": {"type": "object", "properties": {"x": {"not": {}}}}}, "format"),
    ("/api/generate", {"format": {"type": "strin"}}, "format"),
    ("/api/generate", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ("/api/chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/api/chat", {"think": True}, "think"),
    ("/api/chat", {"messages": [{"role": "user", "content": "What is this?", "images": ["aGk="]}]},
     "messages.0.images"),
    ("/api/generate", {"context": [1, 2, 3]}, "context"),
    ("/api/generate", {"raw": True}, "raw"),
    ("/api/generate", {"suffix": "return x"}, "suffix"),
    ("/api/generate", {"template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"images": ["aGk="]}, "images"),
])
def test_what_would_change_the_answer_and_is_not_supported_is_a_400_naming_it(
        app, path: str, extra: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    body = {**(CHAT if path == "/api/chat" else GENERATE), "stream": False, **extra}
    response = client.simulate_post(path, json=body)
    assert response.status_code == 400 and set(response.json) == {"error"}, response.text
    assert response.json["error"].startswith(f"{field}:"), response.json
    assert engine.submitted == []
    assert query(db, "SELECT protocol, status FROM requests") == [("ollama", "rejected")]


def test_errors_have_ollamas_shape(app) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = app
    for response, status in ((client.simulate_post("/api/chat", body="{", headers={"content-type": "application/json"}), 400),
                             (client.simulate_post("/api/chat", json={"messages": []}), 400),
                             (client.simulate_post("/api/show", json={}), 400),
                             (client.simulate_get("/api/nowhere"), 404)):
        assert response.status_code == status and set(response.json) == {"error"}, response.text
        assert isinstance(response.json["error"], str) and response.json["error"]


def test_a_request_without_a_prompt_only_loads_the_model(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    for path, reply in (("/api/generate", {"response": ""}),
                        ("/api/chat", {"message": {"role": "assistant", "content": ""}})):
        response = client.simulate_post(path, json={"model": "fake"})
        assert response.status_code == 200
        assert response.json == {"model": "fake", "created_at": response.json["created_at"], **reply,
                                 "done_reason": "load", "done": True}
    assert engine.submitted == [] and query(db, "SELECT count(*) FROM requests") == [(0,)]


def test_the_model_endpoints(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    tags = client.simulate_get("/api/tags").json["models"]
    assert [m["name"] for m in tags] == ["fake"]
    assert {"model", "modified_at", "size", "digest", "details"} <= set(tags[0])
    show = client.simulate_post("/api/show", json={"model": "fake"}).json
    assert show["model_info"]["general.architecture"] == "unknown"
    assert show["model_info"]["unknown.context_length"] == engine.model.context_length
    assert "completion" in show["capabilities"] and "family" in show["details"]
    ps = client.simulate_get("/api/ps").json["models"]
    assert [m["name"] for m in ps] == ["fake"] and ps[0]["expires_at"]
    assert client.simulate_get("/api/version").json["version"]
    engine.loading = True
    assert client.simulate_get("/api/ps").json == {"models": []}


def test_tool_calls_travel_in_ollamas_shape() -> None:
    """A resent assistant tool call (arguments an object) reaches the prompt as the generic
    tool-call text the OpenAI API writes; a reply's calls come back with arguments as objects."""
    body = {"model": "m", "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]}
    parsed = ollama.parse_chat(body, RequestOptions())
    assert parsed.stream is True and parsed.parse_tools
    assistant = next(m for m in parsed.messages if m.role == "assistant")
    assert "get_weather" in assistant.content and "Paris" in assistant.content
    assert "Sunny" in parsed.messages[-1].content
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}
    assert ollama.chat_message(reply) == {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
