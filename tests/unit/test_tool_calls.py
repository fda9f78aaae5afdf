"""The tool-call text format: rendering, and parsing streamed text split anywhere."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from app.protocol.tools import ToolCall, ToolCallParser, render_call, render_tools_system

TEXT = 'Let me check. <tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la \\"dir\\""}}\n</tool_call>'


def parse_in_pieces(text: str, cuts: list[int]) -> list:
    parser = ToolCallParser()
    segments = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        segments += parser.feed(text[a:b])
    segments += parser.finish()
    merged: list = []
    for seg in segments:  # adjacent text pieces are one text
        if isinstance(seg, str) and merged and isinstance(merged[-1], str):
            merged[-1] += seg
        else:
            merged.append(seg)
    return merged


def test_every_split_position_gives_one_correct_call() -> None:
    expected = ["Let me check. ", ToolCall("Bash", {"command": 'ls -la "dir"'})]
    for cut in range(len(TEXT) + 1):
        assert parse_in_pieces(TEXT, [cut]) == expected, cut
    for cut in range(0, len(TEXT) - 1, 3):
        assert parse_in_pieces(TEXT, [cut, cut + 1, cut + 2]) == expected


@given(st.lists(st.integers(0, len(TEXT)), max_size=8))
def test_any_set_of_splits(cuts: list[int]) -> None:
    assert parse_in_pieces(TEXT, sorted(cuts)) == ["Let me check. ", ToolCall("Bash", {"command": 'ls -la "dir"'})]


def test_invalid_or_unfinished_calls_stay_text() -> None:
    assert parse_in_pieces("a <tool_call>not json</tool_call> b", []) == ["a <tool_call>not json</tool_call> b"]
    assert parse_in_pieces("a <tool_call>{\"name\": \"x\"", []) == ["a <tool_call>{\"name\": \"x\""]
    assert parse_in_pieces("just <tool text", []) == ["just <tool text"]


def test_rendered_calls_parse_back() -> None:
    call = render_call("Read", {"file_path": "/tmp/x"})
    assert parse_in_pieces(call, []) == [ToolCall("Read", {"file_path": "/tmp/x"})]
    system = render_tools_system([{"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}])
    assert "<tool_call>" in system and json.loads(system.splitlines()[-1])[0]["name"] == "Read"


def test_a_forgotten_closing_brace_is_forgiven() -> None:
    text = '<tool_call>\n{"name": "Bash", "arguments": {\n    "command": "ls"\n}\n</tool_call>'
    assert parse_in_pieces(text, []) == [ToolCall("Bash", {"command": "ls"})]
    assert parse_in_pieces('<tool_call>{"name": "Bash", "arguments": {"x": [1}}</tool_call>', []) == [
        '<tool_call>{"name": "Bash", "arguments": {"x": [1}}</tool_call>']  # other damage stays text
