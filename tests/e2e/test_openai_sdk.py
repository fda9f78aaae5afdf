"""The official openai SDK against a real server: chat completions, sessions, errors."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from conftest import ServerProcess
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
    rows = query(server.db_path, "SELECT protocol, match_outcome FROM requests WHERE agent_id = ? ORDER BY created_at",
                 session)
    assert rows == [("openai", "miss"), ("openai", "extend")]
    assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(4,)]


def test_errors_use_the_openai_shape(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[], max_tokens=8)
    assert info.value.body["message"].startswith("messages:")
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{oops")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n:"):
        client.chat.completions.create(model="m", messages=QUESTION, n=2)
