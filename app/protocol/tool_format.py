"""Which tool-call format a turn uses, and what the protocols need of it. Pure.

A model whose chat template defines tools gets them in its own format: the engine
finds its ``ToolSyntax`` (the markers and ``mlx_lm.tool_parsers`` parser that
``mlx_lm.server`` would use), the protocols hand the template structured calls,
results (role ``tool``) and tool definitions, and replies are read with that parser.
Any other model (SmolLM2, Gemma 3) gets the generic text format of
``app.protocol.tools``. Either way a message's identity (its digest) is that of its
generic rendering, so history matches the same whatever model served it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.protocol import tools
from app.protocol.tools import ToolCallParser, call_from
from app.types import ToolCall, ToolSyntax

ToolSpec = dict[str, Any]  # a tool as chat templates take it: {"type": "function", "function": {...}}


def tool_spec(name: str, description: str, parameters: dict[str, Any]) -> ToolSpec:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def forced_start(syntax: ToolSyntax | None, name: str | None) -> str:
    """The start of a reply that must call tool ``name`` (any tool when None).

    In a model's own format it is what its template writes before a call's name
    (and the name, and what follows it up to the arguments), so the next turn renders
    the call as this reply started it. When the template did not show that, only the
    call's start marker is forced (any tool may follow).
    """
    if syntax is None:
        return tools.forced_prefix(name)
    if syntax.call_head is None:
        return syntax.call_start
    return syntax.call_head + (name + syntax.name_tail if name else "")


def end_markers(syntax: ToolSyntax | None) -> tuple[str, ...]:
    """What ends the turn once the reply writes it: a call's closing marker (one call per turn)."""
    if syntax is None:
        return (tools.CALL_END,)
    return (syntax.call_end,) if syntax.call_end else ()


def result_text(content: str, is_error: bool, syntax: ToolSyntax | None) -> str:
    """A tool result as message text: in the generic format inside its tags."""
    if syntax is None:
        return tools.render_result(content, is_error)
    return f"Error: {content}" if is_error else content


def as_arguments(value: Any) -> dict[str, Any]:
    """Call arguments as templates take them: an object (another JSON value wrapped as ``value``)."""
    return value if isinstance(value, dict) else {"value": value}


def _reader(syntax: ToolSyntax, specs: Sequence[ToolSpec]) -> tools.Reader:
    """Reads a call with the model's parser; as in the generic format, a call whose closing
    marker came may have forgotten up to two closing braces (small models do)."""
    offered = list(specs) or None

    def parse(body: str) -> list[ToolCall] | None:
        try:
            found = syntax.parse(body, offered)
        except Exception:  # noqa: BLE001 - a third-party parser reading what a model wrote: not a call
            return None
        calls = [call_from(item) for item in (found if isinstance(found, list) else [found])]
        whole = [c for c in calls if c is not None]
        return whole if whole and len(whole) == len(calls) else None

    return lambda body, closed: tools.repaired(parse, body, closed)


def call_parser(syntax: ToolSyntax | None, specs: Sequence[ToolSpec] = ()) -> ToolCallParser:
    """The streaming splitter for replies in this format (``specs``: the tools offered,
    which some parsers read argument types from)."""
    if syntax is None:
        return ToolCallParser()
    return ToolCallParser(syntax.call_start, syntax.call_end, _reader(syntax, specs))
