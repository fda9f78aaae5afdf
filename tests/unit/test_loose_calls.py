"""Tool calls written as plain JSON (issue 57, item 5): Qwen2.5-Coder 0.5B's fenced object is a
call, as llama.cpp and Ollama take it, but only an object naming an offered tool with arguments
that fit its schema; prose and code stay text, whole or streamed in pieces cut anywhere."""
from __future__ import annotations

import random

import pytest

from app.protocol.loose_calls import LooseCalls, fits
from app.protocol.reply import ReplyParser
from app.types import ToolCall

READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["path"], "additionalProperties": False}}}
OFFERED = (READ_FILE,)
QWEN_REPLY = '```json\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n```'
CALL = ToolCall("read_file", {"path": "src/main.py"})


def parts(text: str, pieces: int = 1, seed: int = 0) -> list[object]:
    """What a reply parser finds in ``text`` fed in ``pieces`` cut at random places, adjacent text joined."""
    parser = ReplyParser(thinking=False, tools=True, offered=OFFERED)
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), pieces - 1)) if pieces > 1 else []
    found: list[object] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        found += parser.feed(text[start:end])
    found += parser.finish()
    joined: list[object] = []
    for part in found:
        if isinstance(part, str) and joined and isinstance(joined[-1], str):
            joined[-1] += part
        else:
            joined.append(part)
    return joined


@pytest.mark.parametrize("pieces", [1, 2, 5, 40])
@pytest.mark.parametrize("text, expected", [
    (QWEN_REPLY, [CALL]),
    ("```\n" + QWEN_REPLY.split("\n", 1)[1], [CALL]),  # a fence without a language tag
    ('{"name": "read_file", "arguments": {"path": "src/main.py"}}', [CALL]),  # bare
    ("I will read it.\n" + QWEN_REPLY + "\nDone.", ["I will read it.\n", CALL, "\nDone."]),
    ('```json\n{"name": "read_file", "arguments": {"path": "src/main.py"}}', [CALL]),  # the fence never closed
])
def test_a_call_to_an_offered_tool_written_as_json_is_a_call(text: str, expected: list[object], pieces: int) -> None:
    for seed in range(3):
        assert parts(text, pieces, seed) == expected


@pytest.mark.parametrize("pieces", [1, 3, 30])
@pytest.mark.parametrize("text", [
    '```json\n{"name": "write_file", "arguments": {"path": "a"}}\n```',  # a tool not offered
    '```json\n{"name": "read_file", "arguments": {"limit": 3}}\n```',  # its required path missing
    '```json\n{"name": "read_file", "arguments": {"path": 7}}\n```',  # a path of another type
    '```json\n{"name": "read_file", "arguments": {"path": "a", "mode": "r"}}\n```',  # closed out
    '```json\n{"a": 1, "b": [1, 2]}\n```',  # JSON that is no call
    '```python\nprint({"name": "read_file", "arguments": {"path": "a"}})\n```',  # code
    'The call is {"name": "read_file", "arguments": {"path": "a"}} as JSON.',  # prose around an object
    '{"name": "read_file", "arguments": {"path": "a"}} and then more text',  # a bare object and more
    "Plain prose with ``` three backticks and no end",
])
def test_prose_code_and_calls_that_do_not_fit_stay_text(text: str, pieces: int) -> None:
    assert parts(text, pieces) == [text]


def test_an_ordinary_code_block_streams_before_it_closes() -> None:
    parser = ReplyParser(thinking=False, tools=True, offered=OFFERED)
    early = parser.feed("Here:\n```python\nimport os\nprint(os.getcwd())\n")
    assert "".join(p for p in early if isinstance(p, str)) == "Here:\n```python\nimport os\nprint(os.getcwd())\n"


def test_without_offered_tools_nothing_is_read_as_a_call() -> None:
    parser = ReplyParser(thinking=False, tools=True)
    assert [*parser.feed(QWEN_REPLY), *parser.finish()] == [QWEN_REPLY]


def test_the_schema_check() -> None:
    schema = READ_FILE["function"]["parameters"]
    assert fits({"path": "a"}, schema) and fits({"path": "a", "limit": 2}, schema)
    assert not fits({"path": "a", "limit": True}, schema)  # a boolean is no integer
    assert not fits({"path": "a", "limit": 2.5}, schema)
    assert fits({"anything": 1}, {"type": "object"})  # open, no properties
    assert fits({"x": None}, {"properties": {"x": {"type": ["string", "null"]}}})


def test_loose_calls_alone_flush_what_they_hold() -> None:
    loose = LooseCalls(OFFERED)
    assert loose.feed("```json\n{\"name\"") == []
    assert loose.flush() == ['```json\n{"name"']
