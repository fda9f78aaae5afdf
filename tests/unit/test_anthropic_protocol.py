import json
from typing import Any

import pytest

from app.errors import InvalidRequest
from app.protocol import anthropic
from app.protocol.reply import Reply
from app.protocol.turn import ParsedTurn
from app.types import ChatMessage, Finished, RequestOptions, Started, TextDelta

BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def parse(body: dict[str, Any]) -> ParsedTurn:
    return anthropic.parse_request(body, RequestOptions(max_output_tokens=1000))


def test_string_and_single_text_block_render_identically() -> None:
    as_string = parse(BASE)
    as_block = parse({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert as_string.messages == as_block.messages == (ChatMessage("user", "hi"),)


def test_system_string_blocks_and_inline_system_role() -> None:
    request = parse({
        **BASE,
        "system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}, {"role": "user", "content": "r"}],
    })
    assert [m.role for m in request.messages] == ["system", "user", "system", "user"]
    assert request.messages[0].content == "a\nb"
    assert parse({**BASE, "system": "plain"}).messages[0] == ChatMessage("system", "plain")


def test_unknown_fields_are_ignored_and_sampling_defaults() -> None:
    request = parse({**BASE, "thinking": {"type": "adaptive"}, "context_management": {}, "whatever": 1})
    assert request.sampling.temperature == 1.0 and request.sampling.max_tokens == 16


def test_session_from_claude_code_user_id() -> None:
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "S-1"})
    assert parse({**BASE, "metadata": {"user_id": user_id}}).session_id == "S-1"
    assert anthropic.session_from_user_id("not json") is None


@pytest.mark.parametrize("body, field", [
    ({k: v for k, v in BASE.items() if k != "model"}, "model"),
    ({k: v for k, v in BASE.items() if k != "messages"}, "messages"),
    ({k: v for k, v in BASE.items() if k != "max_tokens"}, "max_tokens"),
    ({**BASE, "messages": []}, "messages"),
    ({**BASE, "messages": "hi"}, "messages"),
    ({**BASE, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({**BASE, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({**BASE, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({**BASE, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]},
     "messages.0.content.0.input"),
    ({**BASE, "max_tokens": "16"}, "max_tokens"),
    ({**BASE, "max_tokens": 0}, "max_tokens"),
    ({**BASE, "max_tokens": 10**12}, "max_tokens"),
    ({**BASE, "temperature": 3}, "temperature"),
    ({**BASE, "stop_sequences": "END"}, "stop_sequences"),
    ({**BASE, "stream": "yes"}, "stream"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ([1, 2], "body"),
])
def test_malformed_bodies_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    assert str(info.value).startswith(field), str(info.value)


def test_stream_events_follow_anthropic_order() -> None:
    finished = Finished("end_turn", None, 10, 0, 10, 3, 0.1, 0.2)
    events = [Started(10, 0, 10), TextDelta("a"), TextDelta("b"), finished]
    names = [e[0] for e in anthropic.render_events("msg_1", parse(BASE), iter(events)) if not isinstance(e, Reply)]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_usage_adds_up_to_the_prompt() -> None:
    usage = anthropic.usage(100, 30, 70, 5)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == 100
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (30, 70)
    assert anthropic.usage(100, 0, 0, 5)["input_tokens"] == 100


def test_error_shape() -> None:
    assert anthropic.render_error(400, "bad") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}


def test_billing_header_block_is_dropped_from_the_prompt() -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": "You are Claude Code."}]
    request = parse({**BASE, "system": system})
    assert request.messages[0] == ChatMessage("system", "You are Claude Code.")


TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
TOOL_HISTORY = [
    {"role": "user", "content": "List files."},
    {"role": "assistant", "content": [{"type": "text", "text": "Sure."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt\nb.txt"},
                                 {"type": "text", "text": "Which is bigger?"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                      {"type": "text", "text": "Let me check."}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                  "content": [{"type": "text", "text": "permission denied"}]}]},
]


def test_tool_history_renders_through_the_template_text() -> None:
    request = parse({**BASE, "tools": TOOLS, "messages": TOOL_HISTORY})
    assert request.parse_tools and '"name": "Bash"' in request.messages[0].content
    assert request.messages[2].content == 'Sure.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert request.messages[3].content == "<tool_response>\na.txt\nb.txt\n</tool_response>\nWhich is bigger?"
    assert request.messages[4].content == "<think>hmm</think>\nLet me check."  # as the model wrote it
    assert request.messages[5].content == "<tool_response>\nError: permission denied\n</tool_response>"
    assert not parse({**BASE, "tools": TOOLS, "tool_choice": {"type": "none"}}).parse_tools


REPLY = 'I will look. <tool_call>\n{"name": "Bash", "arguments": {"command": "du -h a.txt"}}\n</tool_call>'


def test_streamed_tool_call_split_anywhere_is_one_tool_use_block() -> None:
    request = parse({**BASE, "tools": TOOLS})
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    for cut in range(len(REPLY) + 1):
        events = [Started(10, 0, 10), TextDelta(REPLY[:cut]), TextDelta(REPLY[cut:]), finished]
        out = [e for e in anthropic.render_events("msg_1", request, iter(events)) if not isinstance(e, Reply)]
        starts = [d["content_block"] for n, d in out if n == "content_block_start"]
        assert [b["type"] for b in starts] == ["text", "tool_use"], cut
        assert starts[1]["name"] == "Bash"
        json_parts = [d["delta"]["partial_json"] for n, d in out if n == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta"]
        assert json.loads("".join(json_parts)) == {"command": "du -h a.txt"}
        text = "".join(d["delta"]["text"] for n, d in out if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
        assert text == "I will look. "
        assert [d for n, d in out if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
        assert [d["index"] for n, d in out if n == "content_block_stop"] == [0, 1]


def test_non_streaming_tool_use() -> None:
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    body = anthropic.render_message("msg_1", parse({**BASE, "tools": TOOLS}), REPLY, finished)
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]
    assert body["content"][1]["input"] == {"command": "du -h a.txt"} and body["stop_reason"] == "tool_use"
    plain = anthropic.render_message("msg_1", parse(BASE), REPLY, finished)  # no tools offered: plain text
    assert plain["content"] == [{"type": "text", "text": REPLY}] and plain["stop_reason"] == "end_turn"


THOUGHT = "<think>Two plus two is four.</think>\n\nThe answer is 4."


def test_thinking_becomes_thinking_blocks_when_asked() -> None:
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    thinking = parse({**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    body = anthropic.render_message("msg_1", thinking, THOUGHT, finished)
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "Two plus two is four." and body["content"][0]["signature"]
    assert body["content"][1]["text"] == "The answer is 4."
    plain = anthropic.render_message("msg_1", parse(BASE), THOUGHT, finished)
    assert plain["content"] == [{"type": "text", "text": THOUGHT}]
    for cut in range(len(THOUGHT) + 1):
        events = [Started(10, 0, 10), TextDelta(THOUGHT[:cut]), TextDelta(THOUGHT[cut:]), finished]
        out = [e for e in anthropic.render_events("msg_1", thinking, iter(events)) if not isinstance(e, Reply)]
        deltas = [d["delta"] for n, d in out if n == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == "Two plus two is four."
        assert "".join(d.get("text", "") for d in deltas) == "The answer is 4."
        assert [d["type"] for d in deltas if d["type"] != "thinking_delta"][0] == "signature_delta"
        assert [d["content_block"]["type"] for n, d in out if n == "content_block_start"] == ["thinking", "text"]
        assert [d["index"] for n, d in out if n == "content_block_stop"] == [0, 1]


def sent_blocks(out: list[Any]) -> list[dict[str, Any]]:
    """The content blocks a stream's events sent, whole."""
    blocks: list[dict[str, Any]] = []
    for name, data in (e for e in out if not isinstance(e, Reply)):
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] = block[key] + delta[key]
    return blocks


@pytest.mark.parametrize("fields,reply", [
    ({"tools": TOOLS}, REPLY), ({"tools": TOOLS}, "  \n" + REPLY), ({}, REPLY), ({}, ""),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, THOUGHT),
    ({"messages": [*BASE["messages"], {"role": "assistant", "content": "Sure:"}]}, " yes."),  # a prefill
])
def test_the_stream_records_the_reply_it_sent(fields: dict[str, Any], reply: str) -> None:
    """The ``Reply`` a stream yields holds the blocks it sent (history keeps them: the client
    sends them back), before the closing events; a prefilled reply is the prefill and the reply
    as one message. Cut where it is whole, a stream's blocks are the whole reply's."""
    request = parse({**BASE, **fields})
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    whole = anthropic.whole_reply("msg_1", request, reply, finished)
    assert whole.body is not None and whole.stored is None
    prefilled = ({"role": "assistant", "content": anthropic.content_blocks("msg_1", request, "Sure: yes.")},)
    replied = ({"role": "assistant", "content": whole.body["content"]},)
    assert whole.history == (prefilled if request.prefill else replied)
    for cut in range(len(reply) + 1):
        events = [Started(10, 0, 10), TextDelta(reply[:cut]), TextDelta(reply[cut:]), finished]
        out = list(anthropic.render_events("msg_1", request, iter(events)))
        (at,) = [i for i, e in enumerate(out) if isinstance(e, Reply)]
        sent = ({"role": "assistant", "content": sent_blocks(out)},)
        assert out[at].history == (prefilled if request.prefill else sent), cut
        assert [e[0] for e in out[at + 1:]][-2:] == ["message_delta", "message_stop"]
        if cut in (0, len(reply)):
            assert out[at].history == whole.history


def test_tool_choice_forces_a_call() -> None:
    forced = parse({**BASE, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "Bash"}})
    assert forced.reply_prefix == '<tool_call>\n{"name": "Bash", "arguments": {'
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    body = anthropic.render_message("msg_1", forced, '"command": "pwd"}}\n</tool_call>', finished)
    assert body["content"] == [{"type": "tool_use", "id": body["content"][0]["id"], "name": "Bash",
                                "input": {"command": "pwd"}}]
    assert body["stop_reason"] == "tool_use"
    assert parse({**BASE, "tools": TOOLS, "tool_choice": {"type": "any"}}).reply_prefix == '<tool_call>\n{"name": "'
    assert parse({**BASE, "tools": TOOLS, "tool_choice": {"type": "auto"}}).reply_prefix == ""


@pytest.mark.parametrize("body,field", [
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "Nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [{"description": "no name"}]}, "tools.0.name"),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]},
     "system.0.cache_control.ttl"),
])
def test_bad_tool_thinking_and_cache_fields_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse({**BASE, **body})
    assert str(caught.value).startswith(field + ":"), caught.value


def test_cache_control_ttl_hints() -> None:
    assert parse(BASE).hot_ttl_seconds is None
    ephemeral = {"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}
    assert parse({**BASE, "system": [ephemeral]}).hot_ttl_seconds == 300
    hour = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert parse({**BASE, "system": [ephemeral], "messages": [{"role": "user", "content": [hour]}]}).hot_ttl_seconds == 3600


def test_a_final_assistant_message_is_a_prefill() -> None:
    turn = parse({**BASE, "messages": [{"role": "user", "content": "Capital of France?"},
                                       {"role": "assistant", "content": "The capital is"}]})
    assert [m.role for m in turn.messages] == ["user"] and turn.prefill == "The capital is"
    assert turn.reply_prefix == ""
    finished = Finished("end_turn", None, 10, 0, 10, 20, 0.1, 0.2)
    assert anthropic.render_message("msg_1", turn, " Paris.", finished)["content"] == [
        {"type": "text", "text": " Paris."}]  # only the continuation
    with pytest.raises(InvalidRequest, match="trailing whitespace"):
        parse({**BASE, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi "}]})
    with pytest.raises(InvalidRequest, match="tool_choice"):
        parse({**BASE, "tools": TOOLS, "tool_choice": {"type": "any"},
               "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi"}]})


def test_message_digests_ignore_json_shape_but_not_content() -> None:
    """A conversation is recognised by what the model sees: a string or one text block,
    cache_control anywhere, are the same message; other text, role or system is not."""
    as_string = parse({**BASE, "system": "S", "messages": [{"role": "user", "content": "Hi"}]})
    as_blocks = parse({**BASE, "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
                       "messages": [{"role": "user", "content": [
                           {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]})
    assert as_string.message_digests == as_blocks.message_digests
    assert as_string.system_digest == as_blocks.system_digest
    other = parse({**BASE, "system": "T", "messages": [{"role": "user", "content": "Hi!"}]})
    assert other.system_digest != as_string.system_digest and other.message_digests != as_string.message_digests
    with_tools = parse({**BASE, "system": "S", "messages": [{"role": "user", "content": "Hi"}],
                        "tools": [{"name": "t", "input_schema": {"type": "object"}}]})
    assert with_tools.system_digest != as_string.system_digest  # tools are part of the conversation's start


def test_a_reply_digests_as_the_client_resends_it() -> None:
    turn = parse({**BASE, "messages": [{"role": "user", "content": "Hi"}],
                  "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    reply = anthropic.reply_message("msg_1", turn, 'Sure. <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    resent = parse({**BASE, "messages": [{"role": "user", "content": "Hi"}, reply,
                                         {"role": "user", "content": "thanks"}]})
    assert resent.message_digests[1] == anthropic.message_digest(reply)


def test_parts_locate_a_divergence() -> None:
    from app.protocol.turn import locate_part

    turn = parse({**BASE, "system": "You are terse.", "messages": [
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": "zebra crossing"},
        {"role": "user", "content": "second question"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    labels = [label for label, _ in turn.parts]
    assert labels == ["system", "tools", "messages.0", "messages.1", "messages.2"]
    rendered = "".join(f"[{label}]{part}" for label, part in turn.parts)
    assert locate_part(turn.parts, rendered, rendered.index("second") + 3) == "messages.2"
    assert locate_part(turn.parts, rendered, rendered.index("zebra")) == "messages.1"
    assert locate_part(turn.parts, rendered, rendered.index("terse")) == "system"
    assert locate_part(turn.parts, rendered, rendered.index("[messages.1]")) == "template"


def test_speculate_extension_turns_speculative_decoding_off_per_request() -> None:
    assert parse(BASE).sampling.speculate is True
    assert parse({**BASE, "speculate": False}).sampling.speculate is False
    with pytest.raises(InvalidRequest):
        parse({**BASE, "speculate": "no"})
