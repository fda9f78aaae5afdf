"""The official openai SDK's Responses API against a real server: streaming and not, stored
responses (previous_response_id warm, GET, DELETE, a restart, SQL), tool calls, 400s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ROOT
from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query, wait_persisted

QUESTION = "What is the capital of France?"
WEATHER = [{"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return client_for(server)


def test_create_then_continue_warm_with_previous_response_id(client: openai.OpenAI, server: ServerProcess) -> None:
    first = client.responses.create(model="gpt-5", input=QUESTION, temperature=0, max_output_tokens=16)
    assert first.status == "completed" and first.object == "response" and first.model == "gpt-5"
    assert "Paris" in first.output_text and first.id.startswith("resp_")
    assert first.usage.input_tokens > 10 and first.usage.output_tokens > 0
    second = client.responses.create(model="gpt-5", input="And of Italy?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id and second.output_text.strip()
    # The whole first prompt and reply come from the cache: only the new message is prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    rows = query(server.db_path, "SELECT r.conversation_id, r.n_messages, q.protocol, q.reuse_reason FROM responses r "
                 "JOIN requests q ON q.id = r.request_id WHERE r.id IN (?, ?) ORDER BY r.created_at",
                 first.id, second.id)
    assert [(n, protocol, outcome) for _, n, protocol, outcome in rows] == [(2, "responses", "miss"),
                                                                           (4, "responses", "extend")]
    assert rows[0][0] == rows[1][0]  # one conversation
    stored = query(server.db_path, "SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY position",
                   rows[0][0])
    assert [role for role, _ in stored] == ["user", "assistant", "user", "assistant"]
    assert json.loads(stored[3][1])["content"][0]["text"] == second.output_text


def test_streaming_events_and_the_stream_helper(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="Count from 1 to 50, separated by commas.",
                                          temperature=0, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
        < kinds.index("response.output_item.done")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text and final.usage.output_tokens == 12
    assert final.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model="m", input=QUESTION, temperature=0, max_output_tokens=16) as stream:
        response = stream.get_final_response()
    assert response.status == "completed" and "Paris" in response.output_text


def test_get_and_delete_a_stored_response(client: openai.OpenAI, server: ServerProcess) -> None:
    created = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=8,
                                      metadata={"ticket": "42"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.metadata == {"ticket": "42"} and fetched.usage.input_tokens == created.usage.input_tokens
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(created.id)
    assert info.value.body["message"] == f"response {created.id!r} does not exist"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=created.id)
    unstored = client.responses.create(model="m", input=QUESTION, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert query(server.db_path, "SELECT count(*) FROM responses WHERE id = ?", unstored.id) == [(0,)]


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="m", input=question, tools=WEATHER, tool_choice="required",
                                    temperature=0, max_output_tokens=40)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    history = [*question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    events = list(client.responses.create(model="m", input=history, tools=WEATHER, temperature=0,
                                          max_output_tokens=24, stream=True))
    final = events[-1].response
    assert final.output_text.strip()
    # Resent by the client, the call is rendered back as the model wrote it (canonical JSON; reuse stops
    # at the latest where the model's own spacing differed).
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_bad_requests_are_400s_naming_the_field(client: openai.OpenAI, server: ServerProcess) -> None:
    cases = [({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
              "input.0.content.0"),
             ({"input": QUESTION, "top_logprobs": 3}, "top_logprobs"),
             ({"input": QUESTION, "background": True}, "background"),
             ({"input": QUESTION, "tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}},
              "tool_choice.name"),
             ({"input": QUESTION, "temperature": 5}, "temperature")]
    for fields, where in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", **fields)
        assert info.value.body["param"] == where and info.value.body["message"].startswith(f"{where}:")
    long = httpx.post(f"{server.url}/v1/responses", json={"model": "m", "input": "word " * 9000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    broken = httpx.post(f"{server.url}/v1/responses", content=b"{oops", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"


def test_stored_responses_survive_a_restart_and_are_visible_to_sql(tmp_path: Path, smollm2_dir: Path) -> None:
    home = tmp_path / "home"
    server = start_server(home, smollm2_dir)
    try:
        first = client_for(server).responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=16)
        agent = query(server.db_path, "SELECT agent_id FROM responses WHERE id = ?", first.id)[0][0]
        wait_persisted(server.db_path, agent, first.usage.input_tokens)
    finally:
        stop_server(server)
    server = start_server(home, smollm2_dir)
    try:
        client = client_for(server)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(model="m", input="And of Italy?", previous_response_id=first.id,
                                         temperature=0, max_output_tokens=8)
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # read from disk
    finally:
        stop_server(server)
    listed = subprocess.run([sys.executable, "-m", "app", "sql",
                             "SELECT id, previous_response_id, status FROM responses ORDER BY created_at"],
                            cwd=ROOT, env={**os.environ, "SEMANTIC_HOME": str(home)}, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert first.id in listed.stdout and second.id in listed.stdout and "(2 rows)" in listed.stdout
