"""The official openai SDK against a real server: chat completions, sessions, errors."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from support.servers import ServerProcess
from support.dbcheck import query

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)


def test_non_streaming_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="gpt-5", messages=QUESTION, temperature=0, max_tokens=32)
    assert completion.object == "chat.completion" and completion.model == "gpt-5"
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens > 10 and completion.usage.completion_tokens > 0


def test_streaming_with_usage(client: openai.OpenAI) -> None:
    count = [{"role": "user", "content": "Count from 1 to 50, separated by commas."}]
    chunks = list(client.chat.completions.create(model="m", messages=count, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_session_id_reuses_the_cache(client: openai.OpenAI, server: ServerProcess) -> None:
    session = f"oa-{uuid.uuid4().hex[:8]}"
    first = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=16,
                                           extra_body={"session_id": session})
    history = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="m", messages=history, temperature=0, max_tokens=16,
                                            extra_headers={"X-Session-ID": session})
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    rows = query(server.db_path, "SELECT protocol, reuse_reason FROM requests WHERE agent_id = ? ORDER BY created_at",
                 session)
    assert rows == [("openai", "miss"), ("openai", "extend")]
    assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(4,)]


def test_errors_use_the_openai_shape(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[], max_tokens=8)
    assert info.value.body["message"].startswith("messages:")
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{oops",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n:"):
        client.chat.completions.create(model="m", messages=QUESTION, n=2)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tools_forced_call_result_and_answer(client: openai.OpenAI, server: ServerProcess) -> None:
    """The whole tool loop through the SDK: a call, its result as a ``tool`` message, the answer."""
    session = f"tools-{uuid.uuid4().hex[:8]}"
    first = client.chat.completions.create(
        model="m", messages=WEATHER_QUESTION, tools=WEATHER, temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body={"session_id": session})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)

    history = [*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    chunks = list(client.chat.completions.create(
        model="m", messages=history, tools=WEATHER, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": session}))
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.strip()
    # The second turn reuses the first prompt (the call is rendered back in canonical JSON,
    # which may be spaced differently from what the model wrote: reuse stops there at the latest).
    # Its last token may be one the second prompt's own tokenization merges with what follows
    # (the forced call's opening ends in a space): reuse then stops one token before it.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1

    stored = query(server.db_path, "SELECT role, content FROM messages WHERE agent_id = ? ORDER BY position", session)
    assert [r for r, _ in stored] == ["user", "assistant", "tool", "assistant"]  # resent messages stored once
    reply = json.loads(stored[1][1])
    assert reply["tool_calls"][0]["function"]["name"] == "get_weather" and reply["content"] is None
    assert json.loads(stored[2][1]) == {"tool_call_id": call.id, "content": "Sunny, 21 C"}
    assert json.loads(stored[3][1]) == answer


def test_streamed_tool_calls_accumulate_in_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model="m", messages=WEATHER_QUESTION, tools=WEATHER, tool_choice="required",
                                        temperature=0, max_tokens=40) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        client.chat.completions.create(model="m", messages=WEATHER_QUESTION, tools=WEATHER,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools.0.function.name"):
        client.chat.completions.create(model="m", messages=WEATHER_QUESTION, tools=[{"type": "function",
                                                                                      "function": {}}])
    bad_arguments = [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="messages.0.tool_calls.0.function.arguments"):
        client.chat.completions.create(model="m", messages=bad_arguments, tools=WEATHER)
    with pytest.raises(openai.BadRequestError, match="messages.1.tool_call_id"):
        client.chat.completions.create(model="m", messages=[*WEATHER_QUESTION, {"role": "tool", "content": "x"}])


def test_cache_mode_prefix_and_ttl(client: openai.OpenAI, server: ServerProcess) -> None:
    session = f"modes-{uuid.uuid4().hex[:8]}"
    long_system = {"role": "system", "content": "You answer questions about geography. " * 60}
    turn = [long_system, *QUESTION]
    first = client.chat.completions.create(model="m", messages=turn, temperature=0, max_tokens=8,
                                           extra_body={"session_id": session, "ttl": 7200})
    assert query(server.db_path, "SELECT ttl_seconds FROM agents WHERE id = ?", session) == [(7200,)]
    again = [*turn, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And of Spain?"}]
    full = client.chat.completions.create(model="m", messages=again, temperature=0, max_tokens=8,
                                          extra_body={"session_id": session, "cache_mode": "prefix"})
    cached = full.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 256 == 0 and cached < first.usage.prompt_tokens  # whole blocks only
    with pytest.raises(openai.BadRequestError, match="cache_mode"):
        client.chat.completions.create(model="m", messages=QUESTION, extra_body={"cache_mode": "sometimes"})

    memory_only = f"ttl0-{uuid.uuid4().hex[:8]}"
    client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, extra_body={"session_id": memory_only,
                                                                                          "ttl": 0})
    repeat = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4,
                                            extra_body={"session_id": memory_only, "ttl": 0})
    assert repeat.usage.prompt_tokens_details.cached_tokens > 0  # kept in memory
    assert query(server.db_path, "SELECT count(*) FROM caches WHERE agent_id = ?", memory_only) == [(0,)]


CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))  # ~1,000 tokens


def test_completions_continue_a_raw_prompt_and_reuse_its_blocks(client: openai.OpenAI, server: ServerProcess) -> None:
    """``POST /v1/completions`` through the SDK: the raw prompt continued (no chat template),
    greedy, the same text streamed; a next prompt sharing the first one's whole blocks reads
    them from cache (an editor's next completion in the same file)."""
    first = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=CODE + "def f60(x):\n    return",
                                      max_tokens=8, temperature=0)
    assert first.object == "text_completion" and first.model == "gpt-3.5-turbo-instruct"
    assert first.choices[0].text.strip() and first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.prompt_tokens > 900 and first.usage.completion_tokens > 0
    [(stored,)] = query(server.db_path, "SELECT m.content FROM messages m JOIN requests r ON r.id = m.request_id "
                        "WHERE m.role = 'user' ORDER BY r.created_at DESC LIMIT 1")
    assert json.loads(stored) == CODE + "def f60(x):\n    return"  # history keeps the prompt as sent

    streamed = list(client.completions.create(model="m", prompt=CODE + "def f60(x):\n    return", max_tokens=8,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == first.choices[0].text
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= 768  # whole blocks shared with the first

    edited = client.completions.create(model="m", prompt=CODE + "def g(y):\n    return", max_tokens=4, temperature=0)
    assert edited.usage.prompt_tokens_details.cached_tokens >= 768
    sampled = [client.completions.create(model="m", prompt="def add(a, b):", max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]  # a seed makes sampling reproducible


def test_completions_refuse_what_they_cannot_honour(client: openai.OpenAI) -> None:
    for extra, field in (({"suffix": "\n    return y"}, "suffix"), ({"echo": True}, "echo"),
                         ({"logprobs": 2}, "logprobs"), ({"n": 2}, "n")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="m", prompt="def add(a, b):", max_tokens=4, **extra)
        assert field in refused.value.message, (field, refused.value.message)
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):  # SmolLM2 has no FIM tokens
        client.completions.create(model="m", prompt="def add(a, b):", suffix="\n", max_tokens=4)
