"""ReplyParser: thinking and tool calls found in a reply streamed in arbitrary pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.protocol.reply import ReplyParser, Thinking
from app.protocol.tools import ToolCall, forced_prefix, render_call

REPLY = ('\n<think>The user wants files. I should run ls.</think>\n\nRunning it.'
         '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>')
EXPECTED = [Thinking("The user wants files. I should run ls."), "Running it.", ToolCall("Bash", {"command": "ls"})]


def parse(text: str, cuts: list[int], **options: object) -> list:
    parser = ReplyParser(**{"thinking": True, "tools": True, **options})  # type: ignore[arg-type]
    parts = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        parts += parser.feed(text[a:b])
    parts += parser.finish()
    merged: list = []
    for part in parts:  # adjacent pieces of one kind are one part
        if merged and type(part) is type(merged[-1]) and not isinstance(part, ToolCall):
            merged[-1] = part.__class__(merged[-1].text + part.text) if isinstance(part, Thinking) else merged[-1] + part
        else:
            merged.append(part)
    return merged


def test_every_split_position() -> None:
    for cut in range(len(REPLY) + 1):
        assert parse(REPLY, [cut]) == EXPECTED, cut


@given(st.lists(st.integers(0, len(REPLY)), max_size=10))
def test_any_set_of_splits(cuts: list[int]) -> None:
    assert parse(REPLY, sorted(cuts)) == EXPECTED


def test_think_only_counts_at_the_start_and_only_when_asked() -> None:
    assert parse("Use <think> tags.", []) == ["Use <think> tags."]
    assert parse("<think>a</think>b", [], thinking=False) == ["<think>a</think>b"]
    assert parse("<thi", []) == ["<thi"]  # never became a tag
    assert parse("<think>cut off", [3, 9]) == [Thinking("cut off")]  # max_tokens inside thinking


def test_forced_prefix_is_parsed_as_part_of_the_reply() -> None:
    prefix = forced_prefix("Read")
    assert render_call("Read", {"file_path": "a"}).startswith(prefix)
    assert parse('"file_path": "a"}}\n</tool_call>', [5], prefix=prefix) == [ToolCall("Read", {"file_path": "a"})]
    any_tool = forced_prefix(None)
    assert parse('Bash", "arguments": {"command": "pwd"}}', [], prefix=any_tool) == [  # no closing tag
        ToolCall("Bash", {"command": "pwd"})]
    assert parse("", [], prefix=any_tool) == [any_tool]  # nothing generated: the prefix stays text
