"""Replies in each model family's own tool format, read with the parser mlx-lm ships for it.

Each reply below is written the way a model of that family writes a call (its chat
template's format). Every one must come out as the same call, whole or streamed in
pieces cut anywhere, through the reply parser and through the three protocols'
renderers; text that could start a call is held back until it is known.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol import anthropic, openai, responses, responses_output, structured, tool_format
from app.protocol.reply import Reply, ReplyParser, Thinking
from app.types import Finished, RequestOptions, Started, TextDelta, ToolCall, ToolSyntax
from support.grammar_check import allows, allows_start

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL = ToolCall("get_weather", {"city": "Paris", "days": 3})

# parser module -> a call as that family's models write it (mlx-lm 0.32.2 ships these 15).
REPLIES = {
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "function_gemma": "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
    "glm47": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
    "laguna": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
               "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'),
    "kimi_k3": ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
                '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
                "<|close|>call<|sep|><|close|>tools<|sep|>"),
    "longcat": ("<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
                "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
                "<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>"),
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>',
    "muse_spark": ('<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Paris'
                   '</atem:parameter><atem:parameter name="days">3</atem:parameter></atem:invoke>'
                   "</atem:function_calls>"),
}
LEAD = "Let me look that up. "


def syntax_of(parser: str, head: str | None = None, tail: str = "") -> ToolSyntax:
    """The syntax mlx-lm gives a tokenizer of this family (``head``, ``tail``: what its
    template writes around a call's name)."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolSyntax(parser, module.tool_call_start, module.tool_call_end, head, tail, module.parse_tool_call)


def read(syntax: ToolSyntax, text: str, cuts: list[int], thinking: bool = False) -> list[Any]:
    """The reply's parts, fed in the pieces ``cuts`` makes; adjacent texts merged."""
    parser = ReplyParser(thinking=thinking, tools=True, syntax=syntax, specs=(WEATHER,))
    parts: list[Any] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        parts += parser.feed(text[a:b])
    parts += parser.finish()
    merged: list[Any] = []
    for part in parts:
        if merged and isinstance(part, str) and isinstance(merged[-1], str):
            merged[-1] += part
        elif merged and isinstance(part, Thinking) and isinstance(merged[-1], Thinking):
            merged[-1] = Thinking(merged[-1].text + part.text)
        else:
            merged.append(part)
    return merged


def test_every_family_mlx_lm_ships_is_covered() -> None:
    package = Path(importlib.import_module("mlx_lm.tool_parsers").__path__[0])
    assert {p.stem for p in package.glob("*.py")} - {"__init__"} == set(REPLIES)


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_a_reply_split_at_every_point_gives_its_call(parser: str) -> None:
    syntax = syntax_of(parser)
    text = LEAD + REPLIES[parser]
    for cut in range(len(text) + 1):
        assert read(syntax, text, [cut]) == [LEAD, CALL], (parser, cut)


@pytest.mark.parametrize("parser", sorted(REPLIES))
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_a_reply_split_anywhere_many_times_gives_its_call(parser: str, cuts: list[int]) -> None:
    text = "<think>Weather needs the tool.</think>\n" + LEAD + REPLIES[parser]
    assert read(syntax_of(parser), text, sorted(c % (len(text) + 1) for c in cuts), thinking=True) == [
        Thinking("Weather needs the tool."), LEAD, CALL]


def test_text_that_may_start_a_call_is_held_back_and_released() -> None:
    syntax = syntax_of("gemma4")
    parser = ReplyParser(thinking=False, tools=True, syntax=syntax)
    assert parser.feed("It is <|tool") == ["It is "]  # may be "<|tool_call>"
    assert parser.feed("s|> fine") == ["<|tools|> fine"]  # it was not
    assert parser.finish() == []


def test_several_calls_in_one_reply() -> None:
    mistral = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
    assert read(syntax_of("mistral"), mistral, [20]) == [CALL, ToolCall("get_time", {"tz": "CET"})]
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
            '<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
    assert read(syntax_of("kimi_k2"), kimi, [33, 90]) == [CALL, ToolCall("get_time", {"tz": "CET"})]


def test_what_does_not_read_as_a_call_stays_text() -> None:
    broken = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> done'
    assert read(syntax_of("json_tools"), broken, [9]) == [broken]
    assert read(syntax_of("gemma4"), "<|tool_call>no call here<tool_call|>", []) == [
        "<|tool_call>no call here<tool_call|>"]
    cut_off = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'  # max_tokens inside the call
    assert read(syntax_of("json_tools"), cut_off, [4]) == [cut_off]


def test_json_arguments_sent_as_text_are_read() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}\n</tool_call>'
    assert read(syntax_of("json_tools"), text, []) == [CALL]


def test_a_forced_call_is_parsed_from_the_prompt_s_head() -> None:
    syntax = syntax_of("json_tools", head='<tool_call>\n{"name": "', tail='", "arguments": {')
    prefix = tool_format.forced_start(syntax, "get_weather")
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": {'
    assert tool_format.forced_start(syntax, None) == '<tool_call>\n{"name": "'
    parser = ReplyParser(thinking=False, tools=True, prefix=prefix, syntax=syntax, specs=(WEATHER,))
    rest = REPLIES["json_tools"][len(prefix):]
    assert [*parser.feed(rest[:7]), *parser.feed(rest[7:]), *parser.finish()] == [CALL]
    assert tool_format.forced_start(syntax_of("gemma4"), "get_weather") == "<|tool_call>"  # no head known
    assert tool_format.end_markers(syntax_of("mistral")) == ()
    assert tool_format.end_markers(syntax) == ("</tool_call>",)


# --- the three protocols, with a model of its own format ---------------------------------

SYNTAX = syntax_of("qwen3_coder", head="<tool_call>\n<function=", tail=">\n<")
OPTIONS = RequestOptions(max_output_tokens=64, tool_syntax=SYNTAX)
REPLY = "Checking.\n" + REPLIES["qwen3_coder"]
CUTS = [3, 11, 12, 20, 45, 46, 80, len(REPLY) - 5]  # inside the lead, both markers, a parameter


def events(text: str, cuts: list[int]) -> Iterator[Any]:
    yield Started(10, 0, 10)
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        yield TextDelta(text[a:b])
    yield Finished("end_turn", None, 10, 0, 10, 30, 0.1, 0.2)


def test_anthropic_tool_use_block_whole_and_streamed() -> None:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "description": "The weather in a city.",
                       "input_schema": WEATHER["function"]["parameters"]}]}
    parsed = anthropic.parse_request(body, OPTIONS)
    assert parsed.tool_specs == (WEATHER,) and parsed.sampling.end_after == ("</tool_call>",)
    assert not any("get_weather" in m.content for m in parsed.messages)  # the template writes the tools
    blocks = anthropic.content_blocks("msg_1", parsed, REPLY)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == CALL.arguments
    streamed = [e for e in anthropic.render_events("msg_1", parsed, events(REPLY, CUTS)) if not isinstance(e, Reply)]
    deltas = [d["delta"] for name, d in streamed if name == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "Checking.\n"
    assert [json.loads(d["partial_json"]) for d in deltas if d["type"] == "input_json_delta"] == [CALL.arguments]
    starts = [d["content_block"] for name, d in streamed if name == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["id"] == blocks[1]["id"]
    assert [d for name, d in streamed if name == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_openai_tool_calls_whole_and_streamed() -> None:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER]}
    parsed = openai.parse_request(body, OPTIONS)
    message = openai.reply_message("chatcmpl-1", parsed, REPLY)
    assert message["content"] == "Checking."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == CALL.arguments
    chunks = [c for c in openai.render_chunks("chatcmpl-1", parsed, events(REPLY, CUTS)) if isinstance(c, dict)]
    calls = [d["tool_calls"][0] for c in chunks for d in [c["choices"][0]["delta"]] if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == CALL.arguments
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Checking.\n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_function_call_whole_and_streamed() -> None:
    body = {"model": "m", "input": "Weather in Paris?", "max_output_tokens": 64,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": "required"}
    parsed = responses.parse_request(body, OPTIONS)
    assert parsed.reply_prefix == "<tool_call>\n<function="
    rest = REPLY[len("Checking.\n") + len(parsed.reply_prefix):]
    items = responses_output.reply_items("resp_1", parsed, rest)
    assert [i["type"] for i in items] == ["function_call"] and json.loads(items[0]["arguments"]) == CALL.arguments
    streamed = [e for e in responses_output.render_events("resp_1", parsed, events(rest, [1, 5, 13, 40]))
                if not isinstance(e, Reply)]
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["function_call"] and done[0]["name"] == "get_weather"
    assert json.loads(done[0]["arguments"]) == CALL.arguments



BOUNDED = {"type": "function", "function": {  # every value's text bounded by its type
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}


def _forced(protocol: str, tool: dict[str, Any]) -> Any:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"anthropic": {"model": "m", "max_tokens": 64, "messages": question, "tool_choice": {
                "type": "tool", "name": "get_weather"}, "tools": [
                {"name": "get_weather", "input_schema": tool["function"]["parameters"]}]},
            "openai": {"model": "m", "max_tokens": 64, "messages": question, "tools": [tool],
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "responses": {"model": "m", "input": "Weather in Paris?", "max_output_tokens": 64,
                          "tools": [{"type": "function", **tool["function"]}], "tool_choice": "required"}}[protocol]
    return {"anthropic": anthropic, "openai": openai, "responses": responses}[protocol].parse_request(body, OPTIONS)


@pytest.mark.parametrize("protocol", ["anthropic", "openai", "responses"])
def test_a_forced_call_in_the_xml_format_is_held_to_the_tools_parameters(protocol: str) -> None:
    """Qwen3-Coder's format: the grammar takes the call as the template writes it, its values
    to their types, from the forced start the prompt holds; the parser reads what it takes."""
    parsed = _forced(protocol, BOUNDED)
    constraint = parsed.sampling.constraint
    assert constraint is not None and constraint.prefix == parsed.reply_prefix
    call = REPLIES["qwen3_coder"]
    assert allows_start(constraint.grammar, parsed.reply_prefix) and allows(constraint.grammar, call)
    assert allows(constraint.grammar, call.replace("<parameter=days>\n3\n</parameter>\n", ""))  # optional
    for wrong in (call.replace("<parameter=city>\nParis\n</parameter>\n", ""),  # required
                  call.replace("\n3\n", "\nthree\n"),  # an integer
                  call.replace("Paris", "Lima"),  # not in the enum
                  call.replace("get_weather", "get_time")):
        assert not allows(constraint.grammar, wrong), wrong
    parser = ReplyParser(thinking=False, tools=True, prefix=parsed.reply_prefix, syntax=SYNTAX, specs=(BOUNDED,))
    assert [*parser.feed(call[len(parsed.reply_prefix):]), *parser.finish()] == [CALL]
    # Free text cannot be told from the element's end by the grammar: only the start is forced.
    assert _forced(protocol, WEATHER).sampling.constraint is None


def test_a_forced_call_in_an_own_format_without_a_grammar_forces_only_its_start() -> None:
    bounded = BOUNDED["function"]["parameters"]
    assert structured.forced_call([("get_weather", bounded)], "get_weather", "<|tool_call>",
                                  syntax_of("gemma4")) is None
    no_head = syntax_of("qwen3_coder")  # the template did not show where the name goes
    assert structured.forced_call([("get_weather", bounded)], None, "<tool_call>", no_head) is None
    nested = {"type": "object", "properties": {"ok": {"type": "boolean"}, "where": {"type": "object"}},
              "required": ["ok", "where"]}
    grammar = structured.forced_call([("get_weather", nested)], "get_weather", "", SYNTAX).grammar
    assert allows(grammar, "<tool_call>\n<function=get_weather>\n<parameter=ok>\ntrue\n</parameter>\n"
                           '<parameter=where>\n{"city": "Paris"}\n</parameter>\n</function>\n</tool_call>')
    assert not allows(grammar, "<tool_call>\n<function=get_weather>\n<parameter=ok>\nyes\n</parameter>\n"
                               '<parameter=where>\n{"city": "Paris"}\n</parameter>\n</function>\n</tool_call>')

def test_identity_does_not_depend_on_the_format() -> None:
    """A conversation is the same one (same digests) whichever model's format rendered it."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                            {"type": "text", "text": "Thanks"}]}]
    body = {"model": "m", "max_tokens": 8, "messages": history, "tools": [
        {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}
    generic = anthropic.parse_request(body, RequestOptions(max_output_tokens=64))
    own = anthropic.parse_request(body, OPTIONS)
    assert (own.message_digests, own.system_digest) == (generic.message_digests, generic.system_digest)
    assert [(m.role, m.content, m.tool_calls, m.tool_call_id) for m in own.messages] == [
        ("user", "Weather in Paris?", (), ""),
        ("assistant", "Checking.", (ToolCall("get_weather", {"city": "Paris"}, "toolu_1"),), ""),
        ("tool", "Sunny", (), "toolu_1"),
        ("user", "Thanks", (), "")]
    assert anthropic.message_digest(history[1]) == own.message_digests[1]


def test_forgotten_closing_braces_are_forgiven_in_a_closed_call() -> None:
    """As in the generic format: small models drop the outer brace(s) of a call."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {\n    "city": "Paris",\n    "days": 3\n}\n</tool_call>'
    assert read(syntax_of("json_tools"), text, [30]) == [CALL]
    assert read(syntax_of("gemma4"), '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3<tool_call|>', []) == [
        CALL]
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'  # cut off: never repaired
    assert read(syntax_of("json_tools"), unclosed, []) == [unclosed]
