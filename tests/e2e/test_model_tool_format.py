"""A real server on a model whose chat template defines tools: SmolLM2's weights under the
Qwen2.5 template (tests/support/tool_templates.py), served with the official SDKs.

The tools reach the model through the template, a forced call written in the model's own
format (mlx-lm's json_tools) comes back as a tool_use block / tool_calls, whole and
streamed, and the next turn reuses the whole prompt of the last one. (SmolLM2 was not
trained on this format: it writes a call only when tool_choice forces one, and writes
its JSON pretty-printed, so the cache reuse ends inside its reply, where its spacing
parts from the template's. Unit tests cover replies written exactly as templates write
them, tests/integration/test_model_tool_templates.py the full prefix property.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from app.engine.model import load_spec
from app.engine.prompting import render_chat
from app.protocol import anthropic as anthropic_protocol
from app.types import RequestOptions
from support.servers import ServerProcess, start_server, stop_server
from support.tool_templates import with_template

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"type": "tool", "name": "get_weather"}
GREEDY = {"temperature": 0}  # this anthropic SDK version has no temperature parameter; the server honours it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return with_template(smollm2_dir, tmp_path_factory.mktemp("qwen-template"), "qwen2_5")


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("tool-format-home"), model_dir, {"SEMANTIC_KV_FORMAT": "q8"})
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def claude(tool_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)


def test_the_server_says_which_format_and_renders_tools_through_the_template(
        tool_server: ServerProcess, model_dir: Path) -> None:
    assert "tool calls: its own format (json_tools)" in tool_server.log()
    body = {"model": "m", "system": "Be brief.", "tools": [WEATHER], "messages": QUESTION}
    counted = httpx.post(f"{tool_server.url}/v1/messages/count_tokens", json=body, timeout=60).json()
    spec = load_spec("local", model_dir, kv_format="q8")
    parsed = anthropic_protocol.parse_request({**body, "max_tokens": 1},
                                              RequestOptions(tool_syntax=spec.tool_syntax))
    prompt = render_chat(spec.tokenizer, parsed.messages, tools=parsed.tool_specs)
    assert '# Tools\n\nYou may call one or more functions' in prompt.text and '"name": "get_weather"' in prompt.text
    assert counted["input_tokens"] == prompt.n_tokens


def test_a_forced_call_is_a_tool_use_block_and_the_next_turn_reuses_the_prompt(claude: anthropic.Anthropic) -> None:
    first = claude.messages.create(model="m", max_tokens=64, system="Be brief.", tools=[WEATHER], tool_choice=FORCED,
                                   messages=QUESTION, extra_headers={"x-session-id": "weather-1"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and call.input
    history = [*QUESTION, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}]
    second = claude.messages.create(model="m", max_tokens=16, system="Be brief.", tools=[WEATHER], messages=history,
                                    extra_headers={"x-session-id": "weather-1"}, extra_body=GREEDY)
    # All of the first prompt but its last token: the forced start of the call ends with "{",
    # which the next prompt, where the arguments follow, tokenizes together with them.
    first_prompt = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 1


def test_a_forced_call_streams_as_input_json(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model="m", max_tokens=64, system="Be brief.", tools=[WEATHER],
                                   tool_choice=FORCED, messages=QUESTION, extra_body=GREEDY)
    with claude.messages.stream(model="m", max_tokens=64, system="Be brief.", tools=[WEATHER],
                                tool_choice=FORCED, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_openai_named_tool_call(tool_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    completion = client.chat.completions.create(model="m", messages=QUESTION, tools=tools, tool_choice=named,
                                                temperature=0, max_tokens=64)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)
