"""OpenAI chat completions: parsing tools and tool messages, rendering tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.errors import InvalidRequest
from app.protocol import openai
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.types import ChatMessage, Finished, RequestOptions, Started, TextDelta

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
ASK = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
FINISHED = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
REPLY = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(**body: Any) -> ParsedTurn:
    return openai.parse_request({"model": "m", "messages": [ASK], **body}, RequestOptions(max_output_tokens=1000))


def test_tool_history_renders_as_text_and_results_join_the_next_user_turn() -> None:
    turn = parse(tools=WEATHER, messages=[
        {"role": "system", "content": "Be brief."}, ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
        {"role": "user", "content": "Thanks. Umbrella?"}])
    assert [m.role for m in turn.messages] == ["system", "user", "assistant", "user"]
    assert turn.messages[0].content.startswith("Be brief.\n\nYou can call tools.")
    assert turn.messages[2] == ChatMessage(
        "assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert turn.messages[3].content == ("<tool_response>\nSunny\n</tool_response>\n"
                                        "<tool_response>\n21 C\n</tool_response>\nThanks. Umbrella?")
    assert turn.parse_tools and turn.sampling.end_after == ("</tool_call>",)


def test_tool_choice() -> None:
    assert parse(tools=WEATHER).reply_prefix == ""
    assert parse(tools=WEATHER, tool_choice="required").reply_prefix == '<tool_call>\n{"name": "'
    named = parse(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.reply_prefix == '<tool_call>\n{"name": "get_weather", "arguments": {'
    none = parse(tools=WEATHER, tool_choice="none")
    assert not none.parse_tools and "tool_call" not in none.messages[0].content


@pytest.mark.parametrize("body,field", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"cache_mode": "all"}, "cache_mode"),
    ({"ttl": -1}, "ttl"),
])
def test_bad_fields_are_named(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(**body)
    assert str(caught.value).startswith(field + ":"), caught.value


def test_extensions() -> None:
    turn = parse(session_id="s1", cache_mode="prefix", ttl=0)
    assert (turn.session_id, turn.cache_mode, turn.ttl_seconds) == ("s1", "prefix", 0)
    assert parse().cache_mode == "full" and parse().ttl_seconds is None


def test_tool_calls_in_the_reply() -> None:
    turn = parse(tools=WEATHER)
    body = openai.render_message("chatcmpl-1", turn, REPLY, FINISHED)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert openai.reply_message("chatcmpl-1", turn, REPLY) == choice["message"]
    assert openai.reply_message("chatcmpl-1", parse(), "plain") == {"role": "assistant", "content": "plain"}
    # Resent as the SDK sends it back, the reply is the same message to the model.
    resent = parse(tools=WEATHER, messages=[{"role": "user", "content": "Weather?"}, choice["message"],
                                            {"role": "tool", "tool_call_id": "x", "content": "Sunny"}])
    assert resent.message_digests[1] == openai.message_digest(choice["message"])
    for cut in range(len(REPLY) + 1):
        events = [Started(10, 0, 10), TextDelta(REPLY[:cut]), TextDelta(REPLY[cut:]), FINISHED]
        chunks = [c for c in openai.render_chunks("chatcmpl-1", turn, iter(events)) if isinstance(c, dict)]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
        assert "".join(d.get("content", "") for d in deltas) == "Checking. "
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tools,reply", [(WEATHER, REPLY), (WEATHER, "Just text."), (None, REPLY), (None, "")])
def test_the_stream_records_the_reply_it_sent_as_the_whole_reply_records_it(tools: Any, reply: str) -> None:
    """The ``Reply`` a stream yields holds the message its chunks sent, the same message the whole
    reply has, wherever the text was cut; it comes before the finishing chunk."""
    turn = parse(**({"tools": tools} if tools else {}))
    whole = openai.whole_reply("chatcmpl-1", turn, reply, FINISHED)
    assert whole.body is not None and whole.history == (whole.body["choices"][0]["message"],)
    rendered = openai.render_message("chatcmpl-1", turn, reply, FINISHED)
    assert whole.body == {**rendered, "created": whole.body["created"]}
    for cut in range(len(reply) + 1):
        events = [Started(10, 0, 10), TextDelta(reply[:cut]), TextDelta(reply[cut:]), FINISHED]
        out = list(openai.render_chunks("chatcmpl-1", turn, iter(events)))
        (at,) = [i for i, c in enumerate(out) if isinstance(c, Reply)]
        assert out[at].history == whole.history, cut
        assert [c["choices"][0]["finish_reason"] for c in out[at + 1:] if isinstance(c, dict)][-1] is not None


def test_speculate_extension_turns_speculative_decoding_off_per_request() -> None:
    assert parse().sampling.speculate is True
    assert parse(speculate=False).sampling.speculate is False
    with pytest.raises(InvalidRequest):
        parse(speculate="no")
