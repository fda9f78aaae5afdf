"""A hybrid model in its own tool format, served by a real ``semantic serve``: a tiny random
Qwen3.5-shaped model (linear-attention layers keeping recurrent state beside attention
layers, tests/support/families.py) whose tokenizer has the Qwen3-Coder chat template
(XML calls, mlx-lm's ``qwen3_coder`` parser; tests/support/tool_templates.py).

A tool-using conversation through the OpenAI chat API and Anthropic Messages: turn 1 forces
the call, turn 2 carries the tool's result, turn 3 asks something new. Each later turn
reuses the previous prompt up to its last checkpoint (the recurrent state restored from the
conversation's checkpoints), and turn 3's greedy reply is a fresh server's for the same
request. ``f32`` KV keeps warm and cold bit-identical, so the texts must match exactly.

Turn 2 reuses at least the first prompt but its last token (where its prefill left a
checkpoint). The call itself is computed again when the weights wrote it in pieces the
tokenizer would not split its text into, as random weights held by a grammar do ('Par' +
'is' for 'Paris', seen with logprobs): the reuse stops where the cached tokens part from
the prompt's own tokenization (app/cache/matcher.py; a trained model writes the
tokenizer's own split). Turn 3 reuses at least 95% of turn 2's prompt and reply (here all
of them: the checkpoint at the reply's end).

A forced call in this format is held to the called tool's parameters by a grammar
(``structured.OWN_FORMATS``, app/protocol/structured.py), so even random weights write a call
that comes back parsed; the next turn's history replays it as the client got it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import openai
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.families import save
from support.tool_templates import with_template

F32 = {"SEMANTIC_KV_FORMAT": "f32"}
SYSTEM = "You are a travel assistant. " + " ".join(
    f"Rule {i}: check the weather before suggesting anything outdoors." for i in range(12))
CITIES = ["Paris", "London", "Tokyo"]
# Values whose type bounds their text, which the grammar holds (free text it does not): a city of
# the list, days as digits.
WEATHER = {"name": "get_weather", "description": "The weather in a city, for the next days.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                                             "days": {"type": "integer"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                           "parameters": WEATHER["input_schema"]}}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = "Sunny, 21 C"
NEXT = {"role": "user", "content": "Should I pack an umbrella for tomorrow?"}
GREEDY = {"temperature": 0}
CALL_TOKENS = 64  # enough for a forced call
MIN_REUSE = 0.95


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    weights = save("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "qwen3_5", smollm2_dir)
    return with_template(weights, tmp_path_factory.mktemp("qwen3_5-coder") / "model", "qwen3_coder")


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("warm-home"), model_dir, F32)
    yield server
    stop_server(server)


@pytest.fixture
def fresh(tmp_path: Path, model_dir: Path) -> Iterator[ServerProcess]:
    """A server that has seen nothing (its answers are all cold: not even a shared start)."""
    server = start_server(tmp_path / "fresh-home", model_dir, F32)
    yield server
    stop_server(server)


def test_the_server_reads_calls_in_the_models_own_format(warm: ServerProcess) -> None:
    assert "tool calls: its own format (qwen3_coder)" in warm.log()


def _chat(server: ServerProcess, messages: list[dict], session: str, max_tokens: int = 12,
          **extra: object) -> openai.types.ChatCompletion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="m", messages=[{"role": "system", "content": SYSTEM}, *messages],
                                          tools=TOOLS, max_tokens=max_tokens, extra_headers={"X-Session-ID": session},
                                          **GREEDY, **extra)


def _cached(completion: openai.types.ChatCompletion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def test_openai_a_forced_call_its_result_and_a_new_question_reuse_and_answer_as_cold(
        warm: ServerProcess, fresh: ServerProcess) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = _chat(warm, [QUESTION], "traveller-openai", max_tokens=CALL_TOKENS, tool_choice=named)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in CITIES and isinstance(arguments.get("days", 0), int), arguments

    # The call as the client got it, its result, as a client replays them.
    history = [QUESTION, {"role": "assistant", "content": choice.message.content,
                          "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = _chat(warm, history, "traveller-openai")
    assert _cached(second) >= first.usage.prompt_tokens - 1, (first.usage, second.usage)
    reply = second.choices[0].message
    assert reply.content and not reply.tool_calls

    history += [{"role": "assistant", "content": reply.content}, NEXT]
    third = _chat(warm, history, "traveller-openai")
    assert _cached(third) >= MIN_REUSE * (second.usage.prompt_tokens + second.usage.completion_tokens), (
        second.usage, third.usage)
    cold = _chat(fresh, history, "traveller-openai")
    assert _cached(cold) == 0 and cold.usage.prompt_tokens == third.usage.prompt_tokens
    assert third.choices[0].message.content == cold.choices[0].message.content


def _messages(server: ServerProcess, messages: list[dict], session: str, max_tokens: int = 12,
              **extra: object) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    return client.messages.create(model="m", max_tokens=max_tokens, system=SYSTEM, tools=[WEATHER], messages=messages,
                                  extra_headers={"X-Session-ID": session}, extra_body=GREEDY, **extra)


def _prompt(message: anthropic.types.Message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_anthropic_a_forced_call_its_result_and_a_new_question_reuse_and_answer_as_cold(
        warm: ServerProcess, fresh: ServerProcess) -> None:
    first = _messages(warm, [QUESTION], "traveller-anthropic", max_tokens=CALL_TOKENS,
                      tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in CITIES, call.input

    history = [QUESTION, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}]
    second = _messages(warm, history, "traveller-anthropic")
    assert second.usage.cache_read_input_tokens >= _prompt(first) - 1, (first.usage, second.usage)
    assert second.stop_reason != "tool_use" and second.content[0].type == "text"

    history += [{"role": "assistant", "content": second.content[0].text}, NEXT]
    third = _messages(warm, history, "traveller-anthropic")
    assert third.usage.cache_read_input_tokens >= MIN_REUSE * (_prompt(second) + second.usage.output_tokens), (
        second.usage, third.usage)
    cold = _messages(fresh, history, "traveller-anthropic")
    assert cold.usage.cache_read_input_tokens == 0 and _prompt(cold) == _prompt(third)
    assert [b.model_dump() for b in third.content] == [b.model_dump() for b in cold.content]
