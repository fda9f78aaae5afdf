"""The official anthropic SDK against a real server process serving SmolLM2."""

from __future__ import annotations

import json
import time
import uuid

import anthropic
import httpx
import pytest

from support.servers import ServerProcess
from support.dbcheck import query, request_row

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# This SDK version has no temperature parameter (newer models ignore it); the server honours it.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)


def test_non_streaming_message(client: anthropic.Anthropic, server: ServerProcess) -> None:
    raw = client.messages.with_raw_response.create(
        model="claude-sonnet-5", max_tokens=64, extra_body=GREEDY, messages=QUESTION)
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "claude-sonnet-5"
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn"
    row = request_row(server.db_path, raw.headers["request-id"])
    assert row["status"] == "ok" and row["protocol"] == "anthropic"
    usage = message.usage
    assert row["n_input_tokens"] == (usage.input_tokens + usage.cache_read_input_tokens
                                     + usage.cache_creation_input_tokens)
    assert row["n_output_tokens"] == message.usage.output_tokens
    assert row["ttft_ms"] > 0 and row["total_ms"] >= row["ttft_ms"]
    history = query(server.db_path, "SELECT position, role, content FROM messages WHERE agent_id = ? ORDER BY position",
                    row["agent_id"])
    assert [(p, r) for p, r, _ in history] == [(0, "user"), (1, "assistant")]
    assert json.loads(history[1][2])[0]["text"] == message.content[0].text


def test_streaming_is_incremental(client: anthropic.Anthropic, server: ServerProcess) -> None:
    arrivals: list[tuple[float, str]] = []
    running_at_first_delta = None
    with client.messages.stream(model="claude-sonnet-5", max_tokens=120, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Count from 1 to 100, separated by commas."}]) as stream:
        request_id = stream.response.headers["request-id"]
        for event in stream:
            arrivals.append((time.monotonic(), event.type))
            if event.type == "content_block_delta" and running_at_first_delta is None:
                running_at_first_delta = request_row(server.db_path, request_id)["status"]
        final = stream.get_final_message()
    kinds = [kind for _, kind in arrivals]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [t for t, kind in arrivals if kind == "content_block_delta"]
    assert len(deltas) > 10
    # The first token reached the client while the server was still generating.
    assert running_at_first_delta == "running"
    assert deltas[0] < deltas[-1]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 120
    assert request_row(server.db_path, request_id)["status"] == "ok"


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=64, extra_body=GREEDY, messages=QUESTION,
                                     stop_sequences=["Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert "Paris" not in message.content[0].text


def test_system_as_string_and_blocks_and_inline_system_role(server: ServerProcess) -> None:
    body = {"model": "m", "max_tokens": 8, "temperature": 0,
            "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Answer in English."},
                         {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}],
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"}}
    response = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, timeout=120,
                          headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,unknown-x"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"] > 10


def test_claude_code_session_identifies_the_agent(client: anthropic.Anthropic, server: ServerProcess) -> None:
    session = str(uuid.uuid4())
    user_id = json.dumps({"device_id": "abc", "account_uuid": "", "session_id": session})
    first = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=QUESTION,
                                   metadata={"user_id": user_id})
    history = [*QUESTION, {"role": "assistant", "content": first.content[0].text},
               {"role": "user", "content": "And of Italy?"}]
    client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=history,
                           extra_headers={"X-Claude-Code-Session-Id": session})
    rows = query(server.db_path, "SELECT position, role FROM messages WHERE agent_id = ? ORDER BY position", session)
    assert rows == [(0, "user"), (1, "assistant"), (2, "user"), (3, "assistant")]
    assert query(server.db_path, "SELECT origin FROM agents WHERE id = ?", session) == [("anthropic",)]


def test_prompt_too_long(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hello " * 9000}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith("prompt is too long: ")
    assert info.value.body["error"]["message"].endswith(" tokens > 8191 maximum")


def test_count_tokens_equals_the_cold_prefill(client: anthropic.Anthropic) -> None:
    system = f"Count me {uuid.uuid4().hex}."  # a prompt no agent has cached
    counted = client.messages.count_tokens(model="m", system=system, messages=QUESTION)
    message = client.messages.create(model="m", max_tokens=4, system=system, messages=QUESTION, extra_body=GREEDY)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=[])


def test_conversation_carrying_tool_use_and_results(client: anthropic.Anthropic, server: ServerProcess) -> None:
    tools = [{"name": "Bash", "description": "Run a shell command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    history = [
        {"role": "user", "content": "How many files are here?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                           "input": {"command": "ls | wc -l"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "3"}]},
    ]
    raw = client.messages.with_raw_response.create(model="m", max_tokens=24, tools=tools, messages=history,
                                                   extra_body=GREEDY)
    message = raw.parse()
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use") and message.content
    stored = query(server.db_path, "SELECT content FROM messages WHERE request_id = ? ORDER BY position",
                   raw.headers["request-id"])
    assert json.loads(stored[1][0])[0]["type"] == "tool_use"  # history keeps the blocks as received


BASH = [{"name": "Bash", "description": "Run a shell command",
         "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]


def test_tool_choice_forces_a_tool_use_block(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Run ls."}]
    message = client.messages.create(model="m", max_tokens=40, tools=BASH, messages=ask, extra_body=GREEDY,
                                     tool_choice={"type": "tool", "name": "Bash"})
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "Bash" and isinstance(message.content[0].input, dict)
    with client.messages.stream(model="m", max_tokens=40, tools=BASH, messages=ask, extra_body=GREEDY,
                                tool_choice={"type": "any"}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use" and final.content[-1].name == "Bash"


FEW_SHOT_THINKING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "2 plus 2 equals 4.", "signature": "s"},
                                      {"type": "text", "text": "4"}]},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "3 plus 3 equals 6.", "signature": "s"},
                                      {"type": "text", "text": "6"}]},
    {"role": "user", "content": "What is 5+5?"},
]


def test_thinking_output_becomes_thinking_blocks(client: anthropic.Anthropic) -> None:
    """Earlier thinking is rendered back as <think> text; the real model follows the pattern,
    and its <think> output comes back as thinking blocks (streamed as thinking_delta)."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model="m", max_tokens=60, messages=FEW_SHOT_THINKING, thinking=thinking,
                                     extra_body=GREEDY)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() and message.content[0].signature
    assert "<think>" not in message.content[1].text
    with client.messages.stream(model="m", max_tokens=60, messages=FEW_SHOT_THINKING, thinking=thinking,
                                extra_body=GREEDY) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds and kinds[-1] == "text_delta"
    assert [b.model_dump(include={"type", "thinking"}) for b in final.content] == \
        [b.model_dump(include={"type", "thinking"}) for b in message.content]
    without = client.messages.create(model="m", max_tokens=60, messages=FEW_SHOT_THINKING, extra_body=GREEDY)
    assert [b.type for b in without.content] == ["text"]  # not asked for: the tags stay text


def test_cache_control_ttl_is_recorded_on_the_agent(client: anthropic.Anthropic, server: ServerProcess) -> None:
    session = f"ttl-{uuid.uuid4().hex[:8]}"
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    client.messages.create(model="m", max_tokens=4, system=system, messages=QUESTION, extra_body=GREEDY,
                           extra_headers={"X-Claude-Code-Session-Id": session})
    assert query(server.db_path, "SELECT hot_ttl_seconds FROM agents WHERE id = ?", session) == [(3600,)]
    with pytest.raises(anthropic.BadRequestError, match="system.0.cache_control.ttl"):
        client.messages.create(model="m", max_tokens=4, messages=QUESTION,
                               system=[{**system[0], "cache_control": {"type": "ephemeral", "ttl": "1d"}}])


def test_a_prefilled_assistant_turn_is_continued(client: anthropic.Anthropic) -> None:
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    message = client.messages.create(model="m", max_tokens=8, messages=prefilled, extra_body=GREEDY)
    assert "Paris" in message.content[0].text
    assert not message.content[0].text.startswith("The capital")  # only the continuation comes back
    counted = client.messages.count_tokens(model="m", messages=prefilled).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens + \
        message.usage.cache_creation_input_tokens
