"""Tools through a real tokenizer whose chat template defines them.

No model installed here has such a template, so SmolLM2's tokenizer is given two: the
Qwen2.5 template (JSON calls, mlx-lm's ``json_tools`` parser) and one in Qwen3-Coder's
format (XML calls, ``qwen3_coder``). The tools, earlier calls and results must render
through the template, and each turn's prompt plus the reply the model wrote must be
where the next turn's prompt starts (the cache reuses a conversation by that prefix),
through all three protocols. SmolLM2's and Gemma 3's own templates keep the generic format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.engine.model import ModelSpec, load_spec
from app.engine.prompting import render_chat
from app.protocol import anthropic, openai, responses, responses_output
from app.protocol.turn import ParsedTurn
from app.types import Prompt, RequestOptions
from support.tool_templates import with_template

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CITY = {"city": "Paris"}
# A call as each format writes it, the text before it included (what the model emits; the
# turn ends at the call's closing marker).
CALLS = {
    "qwen2_5": 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": ("I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>"),
}
ANSWER = "It is sunny in Paris."


def templated(template: str, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> ModelSpec:
    return load_spec(template, with_template(smollm2_dir, tmp_path_factory.mktemp(template), template), kv_format="q8")


@pytest.fixture(scope="module", params=sorted(CALLS))
def spec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> ModelSpec:
    return templated(request.param, tmp_path_factory, smollm2_dir)


def render(spec: ModelSpec, parsed: ParsedTurn) -> Prompt:
    prompt = render_chat(spec.tokenizer, parsed.messages, parsed.reply_prefix, tools=parsed.tool_specs, prefill=parsed.prefill)
    assert prompt.n_tokens == len(spec.tokenizer._tokenizer.encode(prompt.text, add_special_tokens=False))
    return prompt


def test_templates_without_tools_keep_the_generic_format(smollm2_dir: Path, gemma3_dir: Path) -> None:
    assert load_spec("smollm2", smollm2_dir, kv_format="q8").tool_syntax is None
    assert load_spec("gemma3", gemma3_dir, kv_format="q8").tool_syntax is None


def test_the_format_is_the_one_mlx_lm_picks_for_the_template(spec: ModelSpec) -> None:
    syntax = spec.tool_syntax
    assert syntax is not None and spec.tokenizer.tool_parser is syntax.parse
    assert (syntax.parser, syntax.call_start, syntax.call_end) == (
        {"qwen2_5": "json_tools", "qwen3_coder": "qwen3_coder"}[spec.name], "<tool_call>", "</tool_call>")
    call = CALLS[spec.name][CALLS[spec.name].index("<tool_call>"):]
    assert syntax.call_head is not None and call.startswith(syntax.call_head + "get_weather" + syntax.name_tail)
    assert (syntax.call_head, syntax.name_tail) == {"qwen2_5": ('<tool_call>\n{"name": "', '", "arguments": {'),
                                                    "qwen3_coder": ("<tool_call>\n<function=", ">\n<")}[spec.name]


def test_tools_calls_and_results_render_through_the_template(spec: ModelSpec) -> None:
    body = {"model": "m", "max_tokens": 8, "system": "Be brief.",
            "tools": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [
                             {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": CITY}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_01", "content": "Sunny, 21 C"}]}]}
    parsed = anthropic.parse_request(body, RequestOptions(max_output_tokens=64, tool_syntax=spec.tool_syntax))
    text = render(spec, parsed).text
    assert "You can call tools" not in text  # not the generic format's section
    tools_at = text.index("# Tools")
    assert text.index("<|im_start|>system\nBe brief.") < tools_at < text.index("get_weather") < text.index("<|im_end|>")
    call = CALLS[spec.name][CALLS[spec.name].index("<tool_call>"):]
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


Conversation = list[dict[str, Any]]


class Client:
    """One protocol as a client drives it: a request for a history, the reply as the client
    sends it back, a tool result, a new user message."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, history: Conversation, options: RequestOptions, force: bool) -> ParsedTurn:
        if self.name == "anthropic":
            body: dict[str, Any] = {"model": "m", "max_tokens": 64, "system": "Be brief.", "messages": history,
                                    "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}
            if force:
                body["tool_choice"] = {"type": "tool", "name": "get_weather"}
            return anthropic.parse_request(body, options)
        if self.name == "openai":
            body = {"model": "m", "max_tokens": 64, "messages": [{"role": "system", "content": "Be brief."}, *history],
                    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}
            if force:
                body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
            return openai.parse_request(body, options)
        body = {"model": "m", "max_output_tokens": 64, "instructions": "Be brief.", "input": history,
                "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]}
        if force:
            body["tool_choice"] = {"type": "function", "name": "get_weather"}
        return responses.parse_request(body, options)

    def reply(self, parsed: ParsedTurn, text: str) -> Conversation:
        if self.name == "anthropic":
            return [anthropic.reply_message("msg_1", parsed, text)]
        if self.name == "openai":
            return [openai.reply_message("chatcmpl-1", parsed, text)]
        return responses_output.history_items("resp_1", parsed, text)

    def result(self, reply: Conversation, output: str) -> Conversation:
        if self.name == "anthropic":
            call = next(b for b in reply[-1]["content"] if b["type"] == "tool_use")
            result = {"type": "tool_result", "tool_use_id": call["id"], "content": output}
            return [{"role": "user", "content": [result]}]
        if self.name == "openai":
            return [{"role": "tool", "tool_call_id": reply[-1]["tool_calls"][0]["id"], "content": output}]
        return [{"type": "function_call_output", "call_id": reply[-1]["call_id"], "output": output}]

    def user(self, text: str) -> Conversation:
        return [{"role": "user", "content": text}]


@pytest.mark.parametrize("protocol", ["anthropic", "openai", "responses"])
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
def test_each_turn_starts_with_the_last_turn_and_its_reply(spec: ModelSpec, protocol: str, forced: bool) -> None:
    """Turn 1 asks (the call forced or not), the model calls the tool; turn 2 carries the result
    and the model answers; turn 3 is a new question. Each prompt starts with the previous
    prompt followed by the reply the model wrote, character for character."""
    client = Client(protocol)
    options = RequestOptions(max_output_tokens=64, tool_syntax=spec.tool_syntax)
    history = client.user("Weather in Paris?")
    first = client.parse(history, options, force=forced)
    call = CALLS[spec.name] if not forced else CALLS[spec.name][CALLS[spec.name].index("<tool_call>"):]
    assert call.startswith(first.reply_prefix) and (not forced or "get_weather" in first.reply_prefix)
    written = call[len(first.reply_prefix):]  # what the model generates after the prompt
    reply = client.reply(first, written)
    history += reply + client.result(reply, "Sunny, 21 C")
    second = client.parse(history, options, force=False)
    turns: list[tuple[ParsedTurn, str]] = [(first, written), (second, ANSWER)]
    history += client.reply(second, ANSWER) + client.user("And tomorrow?")
    third = client.parse(history, options, force=False)
    for (before, generated), after in zip(turns, (second, third)):
        kept = render(spec, before).text + generated
        assert render(spec, after).text.startswith(kept)


def test_a_call_written_unlike_the_template_costs_only_the_reply(tmp_path_factory: pytest.TempPathFactory,
                                                                 smollm2_dir: Path) -> None:
    """A model that spaces its JSON differently from the template's ``tojson`` still gets the
    whole prompt of the last turn reused: only the reply's text parts from the new prompt."""
    spec = templated("qwen2_5", tmp_path_factory, smollm2_dir)
    client = Client("openai")
    options = RequestOptions(max_output_tokens=64, tool_syntax=spec.tool_syntax)
    first = client.parse(client.user("Weather in Paris?"), options, force=False)
    written = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    reply = client.reply(first, written)
    assert json.loads(reply[0]["tool_calls"][0]["function"]["arguments"]) == CITY
    second = client.parse(client.user("Weather in Paris?") + reply + client.result(reply, "Sunny"), options, False)
    before, after = render(spec, first).text, render(spec, second).text
    assert after.startswith(before) and not after.startswith(before + written)
    assert after.startswith(before + '<tool_call>\n{"name":')


def test_several_calls_and_their_results_render_in_order(spec: ModelSpec) -> None:
    """An OpenAI message of two calls, then their two results: one user turn, in order."""
    calls = [{"id": f"call_{city}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}} for city in ("Paris", "Rome")]
    history: Conversation = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_Paris", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_Rome", "content": "Rainy"}]
    parsed = Client("openai").parse(history, RequestOptions(max_output_tokens=64, tool_syntax=spec.tool_syntax), False)
    text = render(spec, parsed).text
    results = "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>"
    assert results in text and text.index(results) < text.index("<tool_response>\nRainy\n</tool_response>")
    assert text.count("<|im_start|>user") == 2
    assert text.index('"Paris"' if spec.name == "qwen2_5" else "\nParis\n") < text.index(
        '"Rome"' if spec.name == "qwen2_5" else "\nRome\n")
