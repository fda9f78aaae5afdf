"""The assistant's reply as content: thinking, text and tool calls, found in streamed text. Pure.

A reply may open with ``<think>...</think>`` (reasoning models write it; the
Anthropic API returns it as a ``thinking`` block) and may contain tool calls
in the generic format of ``app.protocol.tools`` or the model's own
(``app.protocol.tool_format``). ``ReplyParser`` splits text arriving
in arbitrary pieces into those parts, holding back only what could still be
the start of a tag.

``Reply`` is a finished reply as its protocol built it, once per turn: the whole
response, or what a stream sent (its renderer yields it among its events, before the
stream's closing ones). The API records it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.protocol.loose_calls import LooseCalls
from app.protocol.tool_format import ToolSpec, call_parser
from app.protocol.tools import partial_suffix
from app.protocol.turn import ParsedTurn
from app.types import ToolCall, ToolSyntax

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class Thinking:
    """A piece of the reply's reasoning."""

    text: str


Part = str | Thinking | ToolCall


@dataclass(frozen=True, slots=True)
class Reply:
    """A finished reply as its protocol built it: what history keeps and what the client got whole."""

    history: tuple[dict[str, Any], ...]  # the reply's messages as the client sends them back
    body: dict[str, Any] | None = None  # the whole response (None: it went out as a stream)
    stored: dict[str, Any] | None = None  # the response object to keep with the turn (Responses API ``store``)


class ReplyParser:
    """Splits a streamed reply into text, ``Thinking`` and ``ToolCall`` parts.

    ``prefix`` is text the reply already starts with in the prompt (a forced
    tool call); it is parsed as if the model had written it. Tool calls are
    read in ``syntax`` (None: the generic format), with the tools ``specs``; a call to one of
    the ``offered`` tools written as plain JSON counts too (``app.protocol.loose_calls``).
    """

    def __init__(self, *, thinking: bool, tools: bool, prefix: str = "", syntax: ToolSyntax | None = None,
                 specs: tuple[ToolSpec, ...] = (), offered: tuple[ToolSpec, ...] = ()) -> None:
        self._state = "start" if thinking else "body"
        self._buffer = ""
        self._strip = False  # drop whitespace between </think> and the answer
        self._calls = call_parser(syntax, specs) if tools else None
        self._loose = LooseCalls(offered) if tools and offered and not prefix else None
        self._prefix = prefix

    @classmethod
    def for_turn(cls, turn: ParsedTurn) -> ReplyParser:
        return cls(thinking=turn.parse_thinking, tools=turn.parse_tools, prefix=turn.reply_prefix,
                   syntax=turn.tool_syntax, specs=turn.tool_specs, offered=turn.offered_tools)

    def feed(self, text: str) -> list[Part]:
        text, self._prefix = self._prefix + text, ""
        if self._state == "body":
            return self._body(text)
        self._buffer += text
        if self._state == "start":
            opening = self._buffer.lstrip()
            if opening.startswith(THINK_START):
                self._buffer, self._state = opening[len(THINK_START):], "thinking"
            elif THINK_START.startswith(opening):
                return []  # may still become <think>
            else:
                rest, self._buffer, self._state = self._buffer, "", "body"
                return self._body(rest)
        end = self._buffer.find(THINK_END)
        if end >= 0:
            thought, rest = self._buffer[:end], self._buffer[end + len(THINK_END):]
            self._buffer, self._state, self._strip = "", "body", True
            return [*([Thinking(thought)] if thought else []), *self._body(rest)]
        keep = partial_suffix(self._buffer, THINK_END)
        ready, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return [Thinking(ready)] if ready else []

    def finish(self) -> list[Part]:
        """The rest, once generation ended (unfinished thinking is still thinking)."""
        out = self.feed("") if self._prefix else []
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking" and rest:
            out.append(Thinking(rest))
        elif rest:
            out.extend(self._body(rest))
        self._state = "body"
        if self._calls is not None:
            out.extend(self._loosely(self._calls.finish()))
        if self._loose is not None:
            out.extend(self._loose.finish())
        return out

    def _body(self, text: str) -> list[Part]:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if not text:
            return []
        return self._loosely(self._calls.feed(text)) if self._calls is not None else [text]

    def _loosely(self, parts: list[str | ToolCall]) -> list[Part]:
        """The format's parts with the text's plain-JSON calls found."""
        if self._loose is None:
            return list(parts)
        out: list[Part] = []
        for part in parts:
            out.extend(self._loose.feed(part) if isinstance(part, str) else [*self._loose.flush(), part])
        return out


def parse_reply(turn: ParsedTurn, text: str) -> list[Part]:
    """A whole reply's parts, as ``turn`` asks them to be found."""
    parser = ReplyParser.for_turn(turn)
    return [*parser.feed(text), *parser.finish()]
