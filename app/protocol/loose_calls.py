"""Tool calls a small model writes as plain JSON instead of its format's markers. Pure.

Qwen2.5-Coder 0.5B, offered a ``read_file`` tool and asked to read a file, answers with a
fenced object, ```` ```json {"name": "read_file", "arguments": {"path": "src/main.py"}} ``` ````,
and no ``<tool_call>`` tags. The servers users compare with take that as a call: llama.cpp's
Hermes parser (the one it uses for Qwen 2.5) accepts a JSON object starting with ``"name"``
in a plain or ``json`` code fence, or bare, and Ollama accepts a JSON object that names an
offered tool. Here such an object is a call only if it names a tool the request offered and
its arguments fit that tool's schema (``fits``), so ordinary prose and code stay text:

* a code fence (```` ``` ```` or ```` ```json ````) whose first character is ``{`` holds one
  object, and only that, between its fences;
* a reply that starts with ``{`` is one object and nothing after it.

Streamed text passes through at once, except such a fence (held until it closes) and a reply
that starts with ``{`` (held to its end): either comes out as the call, or as the text it was.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from app.protocol.tools import Segment, call_from, partial_suffix
from app.types import ToolCall

FENCE = "```"
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),),
}
_HEAD_LIMIT = 16  # characters a fence's language tag may take before the fence is plain text


def _is(value: Any, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:
        return True  # a type this check does not know: not held against the call
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, types)


def fits(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Whether ``arguments`` fit a tool's JSON schema: its required properties present, none it
    closes out (``additionalProperties: false``), each property's JSON type as declared."""
    properties = schema.get("properties") or {}
    if any(name not in arguments for name in schema.get("required") or ()):
        return False
    if schema.get("additionalProperties") is False and any(name not in properties for name in arguments):
        return False
    for name, value in arguments.items():
        kind = (properties.get(name) or {}).get("type")
        kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
        if kinds and not any(_is(value, k) for k in kinds):
            return False
    return True


class LooseCalls:
    """Finds calls written as plain JSON in a reply's text (after its format's own calls are
    found): ``feed`` text as it streams, ``finish`` at its end, ``flush`` before a call the
    format found. ``offered``: the tools as chat templates take them."""

    def __init__(self, offered: Sequence[dict[str, Any]]) -> None:
        self._schemas = {}
        for tool in offered:
            function = tool.get("function", tool)
            if isinstance(function.get("name"), str):
                self._schemas[function["name"]] = function.get("parameters") or {}
        self._buffer = ""
        self._state = "start"  # start | bare | text | head | call | plain

    def _call(self, text: str) -> ToolCall | None:
        """The call ``text`` is, whole: one JSON object naming an offered tool with fitting arguments."""
        try:
            value, end = json.JSONDecoder().raw_decode(text.strip())
        except ValueError:
            return None
        if text.strip()[end:].strip():
            return None
        call = call_from(value)
        if call is None or call.name not in self._schemas or not fits(call.arguments, self._schemas[call.name]):
            return None
        return call

    def feed(self, text: str) -> list[Segment]:
        self._buffer += text
        out: list[Segment] = []
        while True:
            if self._state == "start":
                opening = self._buffer.lstrip()
                if not opening:
                    return out
                self._state = "bare" if opening.startswith("{") else "text"
            if self._state == "bare":
                return out
            if self._state == "text":
                at = self._buffer.find(FENCE)
                if at < 0:
                    return [*out, *self._ready()]
                if at:
                    out.append(self._buffer[:at])
                self._buffer, self._state = self._buffer[at:], "head"
            if self._state == "head":
                head, newline, body = self._buffer[len(FENCE):].partition("\n")
                if not newline:
                    if len(head) <= _HEAD_LIMIT:
                        return out  # the language tag may still be coming
                    self._state = "plain"
                elif head.strip().lower() not in ("", "json"):
                    self._state = "plain"
                elif not body.lstrip():
                    return out  # the block's first character may still be "{"
                else:
                    self._state = "call" if body.lstrip().startswith("{") else "plain"
                if self._state == "plain":  # an ordinary code block: out at once, to its closing fence
                    out.append(FENCE)
                    self._buffer = self._buffer[len(FENCE):]
            if self._state == "plain":
                at = self._buffer.find(FENCE)
                if at < 0:
                    return [*out, *self._ready()]
                out.append(self._buffer[:at + len(FENCE)])
                self._buffer, self._state = self._buffer[at + len(FENCE):], "text"
                continue
            if self._state == "call":
                at = self._buffer.find(FENCE, len(FENCE))
                if at < 0:
                    return out
                end = at + len(FENCE)
                block, self._buffer, self._state = self._buffer[:end], self._buffer[end:], "text"
                call = self._call(block[len(FENCE):at].partition("\n")[2])
                out.append(call if call is not None else block)

    def _ready(self) -> list[Segment]:
        """The buffer but what may be the start of a fence."""
        cut = len(self._buffer) - partial_suffix(self._buffer, FENCE)
        ready, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return [ready] if ready else []

    def flush(self) -> list[Segment]:
        """What is held, as the text it is (a call the format found comes next)."""
        held, self._buffer = self._buffer, ""
        self._state = "text"
        return [held] if held else []

    def finish(self) -> list[Segment]:
        """The rest at the reply's end: a bare object, or a fence that never closed, may be a call."""
        held, state = self._buffer, self._state
        self._buffer, self._state = "", "text"
        if state == "bare" or (state == "call" and held.startswith(FENCE)):
            call = self._call(held if state == "bare" else held[len(FENCE):].partition("\n")[2])
            if call is not None:
                return [call]
        return [held] if held else []
