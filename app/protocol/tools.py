"""Tool calls for chat templates without tool support: a documented text format. Pure.

Tools are described in the system prompt; the model calls one by writing

    <tool_call>
    {"name": "Bash", "arguments": {"command": "ls"}}
    </tool_call>

(the JSON tool-call format of mlx-lm's ``json_tools`` parser, Hermes/Qwen
style). Earlier calls and their results are rendered back the same way, with
results inside ``<tool_response>`` tags. ``ToolCallParser`` finds calls in
streamed text split at arbitrary points. The turn ends after a call's closing
tag (the model waits for the result, as on the real APIs): one call per turn.
The same splitter reads a model's own format (``app.protocol.tool_format``) with
that format's markers and parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from app.types import ToolCall

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
RESULT_START = "<tool_response>"
RESULT_END = "</tool_response>"


DESCRIPTION_CHARS = 300


def _compact(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool definition small enough for a small model's context: the first
    paragraph of its description and its parameters' names, types and whether
    they are required (full JSON schemas of real clients run to thousands of tokens)."""
    description = str(tool.get("description", "")).strip().split("\n\n")[0][:DESCRIPTION_CHARS]
    schema: dict[str, Any] = tool["input_schema"] if isinstance(tool.get("input_schema"), dict) else {}
    required = {r for r in schema.get("required", []) if isinstance(r, str)} \
        if isinstance(schema.get("required"), list) else set()
    properties: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    parameters = {str(name): f"{spec.get('type', 'any')}{'' if name in required else ' (optional)'}"
                  for name, spec in properties.items() if isinstance(spec, dict)}
    return {"name": tool.get("name"), "description": description, "parameters": parameters}


def render_tools_system(tools: list[dict[str, Any]]) -> str:
    """The system prompt section that offers ``tools`` (Anthropic tool definitions)."""
    return ("You can call tools. To call one, answer with exactly\n"
            f"{CALL_START}\n{{\"name\": <tool name>, \"arguments\": <JSON object>}}\n{CALL_END}\n"
            "and nothing after it. Available tools:\n"
            + json.dumps([_compact(t) for t in tools], ensure_ascii=False))


def render_call(name: str, arguments: Any) -> str:
    return f"{CALL_START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_END}"


def forced_prefix(name: str | None) -> str:
    """The start of a reply that must call tool ``name`` (any tool when None).

    It is appended to the prompt, so the model can only continue the call (for
    a named tool, inside its arguments object); it is written exactly as
    ``render_call`` writes calls back into history, so the next turn reuses it.
    """
    if name is None:
        return f'{CALL_START}\n{{"name": "'
    return f'{CALL_START}\n{json.dumps({"name": name}, ensure_ascii=False)[:-1]}, "arguments": {{'


def render_result(content: str, is_error: bool) -> str:
    return f"{RESULT_START}\n{'Error: ' if is_error else ''}{content}\n{RESULT_END}"


Segment = str | ToolCall
# Reads the text between a call's markers: the calls it holds, or None if it is no call.
# ``closed``: the closing marker came (else generation ended inside the call).
Reader = Callable[[str, bool], list[ToolCall] | None]


UNCLOSED_BRACES = 2  # small models often forget the outer closing brace(s)


def repaired(read: Callable[[str], list[ToolCall] | None], body: str, closed: bool) -> list[ToolCall] | None:
    """What ``read`` finds in a call's ``body``; in a call whose closing marker came, with
    up to ``UNCLOSED_BRACES`` forgotten closing braces added if it finds nothing (an
    unfinished call may be cut anywhere: never repaired)."""
    for closing in range(UNCLOSED_BRACES + 1 if closed else 1):
        calls = read(body.rstrip() + "}" * closing if closing else body)
        if calls:
            return calls
    return None


def call_from(data: Any) -> ToolCall | None:
    """A call from its JSON shape: ``name`` and ``arguments`` (or ``parameters``; an
    arguments object sent as JSON text is read; another value is wrapped as ``value``)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str) and arguments.lstrip().startswith("{"):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return ToolCall(data["name"], arguments if isinstance(arguments, dict) else {"value": arguments})


def _json_call(body: str) -> list[ToolCall] | None:
    try:
        call = call_from(json.loads(body))
    except ValueError:
        return None
    return [call] if call is not None else None


def read_generic(body: str, closed: bool) -> list[ToolCall] | None:
    return repaired(_json_call, body, closed)


class ToolCallParser:
    """Split streamed text into plain text and complete tool calls.

    Text that might be the start of the ``start`` marker is held back; calls are
    emitted once the ``end`` marker arrives (an empty ``end``: when the text ends).
    Defaults: the generic format. A call ``read`` finds nothing in is passed
    through as text.
    """

    def __init__(self, start: str = CALL_START, end: str = CALL_END, read: Reader = read_generic) -> None:
        self._start, self._end, self._read = start, end, read
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> list[Segment]:
        self._buffer += text
        out: list[Segment] = []
        while True:
            if self._inside:
                end = self._buffer.find(self._end) if self._end else -1
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self._end):]
                self._inside = False
                calls = self._read(body, True)
                if calls:
                    out.extend(calls)
                else:
                    out.append(self._start + body + self._end)
                continue
            start = self._buffer.find(self._start)
            if start >= 0:
                if start:
                    out.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self._start):]
                self._inside = True
                continue
            keep = partial_suffix(self._buffer, self._start)
            ready = self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            if ready:
                out.append(ready)
            return out

    def finish(self) -> list[Segment]:
        """Whatever is left when generation ends. A call cut off before its closing
        marker (or one that has none) still counts if it reads whole; else it is text."""
        calls = self._read(self._buffer, False) if self._inside else None
        rest = (self._start if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        if calls:
            return list(calls)
        return [rest] if rest else []


def partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
