"""Structured outputs: a request's output format as a grammar the engine holds the reply to. Pure.

Every API's way of asking for JSON (OpenAI chat ``response_format``, the Responses API's
``text.format``, Ollama's ``format``, Anthropic's ``output_format``) becomes an
``OutputConstraint``: llguidance's grammar text, checked here (a schema it cannot hold is a
400 naming the field), which the engine turns into a token mask (``app/engine/grammar.py``).
The JSON is written in one style, the one ``json.dumps`` and the generic tool format use
(``", "`` between items, ``": "`` after keys, no other whitespace): a small model cannot then
pad it with endless newlines, and a tool call's arguments come back exactly as history writes
them. A schema's own ``x-guidance`` options override that.

The prompt says so too (``instructions``: the schema, written deterministically, after the
system prompt), so the model knows what the mask allows; the mask is what holds.

An object schema that lists ``properties`` and says nothing of others is held closed
(``closed``: ``additionalProperties: false``), as llama.cpp and Ollama hold it: open, a
small model adds keys until its token limit. A schema that wants other keys says so
(``additionalProperties: true`` or a schema for them).

When tools are offered (the generic tool format), the reply may be the JSON answer or one
tool call (``with_tools``). A forced call in that format (``forced_call``) is held to the
called tool's ``input_schema``, leniently: a keyword the grammar cannot express is left
out of the mask, and a schema it cannot read at all leaves the call unconstrained, as
before.

A forced call in a model's own format is held too where its parser's format is known here
(``OWN_FORMATS``: Qwen3-Coder's and Qwen3.5's XML calls, ``qwen3_coder``): the call as the
model's template writes it, each parameter's value to its type, when every parameter's type
bounds its text (numbers, booleans, ``enum`` members, JSON objects and arrays: not free
text, which the grammar cannot end). Other calls and own formats force only the call's
start, as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance

from app.errors import InvalidRequest
from app.protocol import tools
from app.types import OutputConstraint, ToolSyntax

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # "JSON mode": any JSON object

Tool = tuple[str, dict[str, Any]]  # (name, input JSON schema)


_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")  # a schema each
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")  # a list of schemas each
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")  # schemas by name


def closed(schema: Any) -> Any:
    """``schema`` with each object that lists ``properties`` and says nothing of others
    (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``) closed
    to them, at every depth. ``allOf`` branches stay as they are: each one's keys are the
    others' additional ones."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(value) for name, value in out[key].items()}
    says_more = any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
    if isinstance(out.get("properties"), dict) and not says_more:
        out["additionalProperties"] = False
    return out


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    options = schema.get("x-guidance")
    return {**closed(schema), "x-guidance": {**JSON_STYLE, **(options if isinstance(options, dict) else {})}}


def _compiles(grammar: str) -> str:
    """"" when llguidance can hold ``grammar``, else why not."""
    return llguidance.LLMatcher.validate_grammar(grammar)


def _json_rule(schema: dict[str, Any], lenient: bool) -> str | None:
    """A lark rule body holding JSON to ``schema``; None when llguidance cannot hold it."""
    styled = _styled(schema)
    if lenient:
        styled["x-guidance"] = {"lenient": True, **styled["x-guidance"]}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(styled)
    except ValueError:
        return None
    return None if _compiles(grammar) else f"%json {json.dumps(styled, ensure_ascii=False)}"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _call_rules(offered: Sequence[Tool], names: Sequence[str] | None = None) -> list[str]:
    """Lark rules: ``call``, one call in the generic format of one of ``offered`` (``names``:
    only these), its arguments held to the tool's schema where llguidance can hold it."""
    rules, alternatives = [], []
    for i, (name, schema) in enumerate(offered):
        if names is not None and name not in names:
            continue
        object_schema = schema if isinstance(schema, dict) and schema else ANY_OBJECT
        args = _json_rule(object_schema, lenient=True) or _json_rule(ANY_OBJECT, lenient=False)
        head = f"{tools.CALL_START}\n{json.dumps({'name': name}, ensure_ascii=False)[:-1]}, \"arguments\": "
        rules += [f"call{i}: {_literal(head)} args{i} {_literal('}' + chr(10) + tools.CALL_END)}", f"args{i}: {args}"]
        alternatives.append(f"call{i}")
    return [f"call: {' | '.join(alternatives)}", *rules]


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """A local ``$ref`` (``#/$defs/node``) of ``root``; None if it points nowhere."""
    node: Any = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref.startswith("#") else [None]:
        if part is None or not isinstance(node, dict):
            return None
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if part else node
    return node


def endless(root: dict[str, Any]) -> str | None:
    """Why no JSON value fits ``root`` in finitely many characters (a ``$ref`` that requires
    itself: a node whose required child is a node), or None. An alternative (``anyOf``,
    ``oneOf``) is endless only if each of its branches is; an optional property or an array
    that may be empty ends it."""
    def required_refs(node: Any, path: tuple[str, ...], depth: int = 0) -> str | None:
        if not isinstance(node, dict) or depth > 64:
            return None
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in path:
                return " -> ".join((*path[path.index(ref):], ref))
            return required_refs(_resolve(root, ref), (*path, ref), depth + 1)
        for key in ("allOf",):
            for branch in node.get(key) or ():
                if (found := required_refs(branch, path, depth + 1)) is not None:
                    return found
        for key in ("anyOf", "oneOf"):
            branches = node.get(key) or ()
            found_all = [required_refs(branch, path, depth + 1) for branch in branches]
            if branches and all(found_all):
                return found_all[0]
        properties = node.get("properties") or {}
        for name in node.get("required") or ():
            if isinstance(name, str) and (found := required_refs(properties.get(name), path, depth + 1)) is not None:
                return found
        if (node.get("minItems") or 0) >= 1:
            return required_refs(node.get("items"), path, depth + 1)
        return None

    return required_refs(root, ("#",)) if isinstance(root, dict) else None


def response_format(schema: dict[str, Any] | None, where: str, prefix: str = "",
                    offered: Sequence[Tool] = ()) -> OutputConstraint:
    """The reply held to JSON matching ``schema`` (None: any JSON object); ``prefix``: the
    reply's start the prompt holds; ``offered``: tools the reply may call instead (one call,
    in the generic format).

    Raises:
        InvalidRequest: naming ``where``, when llguidance cannot hold the schema (an
            unsupported keyword, a dangling ``$ref``, ...) or no finite JSON fits it (``endless``).
    """
    schema = ANY_OBJECT if schema is None else schema
    cycle = endless(schema)
    if cycle is not None:
        raise InvalidRequest(f"{where}: no finite JSON fits the schema: its required properties recurse ({cycle})",
                             where)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_styled(schema))
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not a JSON schema: {exc}", where) from None
    why = _compiles(grammar)
    if why:
        raise InvalidRequest(f"{where}: this server cannot hold replies to the schema: {why}", where)
    if offered:
        answer = _json_rule(schema, lenient=False)
        grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(
            ["start: answer | call", f"answer: {answer}", *_call_rules(offered)]))
        why = _compiles(grammar)
        if why:
            raise InvalidRequest(f"{where}: this server cannot hold replies to the schema with the tools offered: "
                                 f"{why}", where)
    return OutputConstraint(grammar, prefix, where)


def forced_call(offered: Sequence[Tool], name: str | None, prefix: str,
                syntax: ToolSyntax | None = None) -> OutputConstraint | None:
    """A forced call held to the called tool's input schema (``name`` None: any offered
    tool's), in the generic format (``syntax`` None) or in the model's own; ``prefix``: its
    start, which the prompt holds (``tool_format.forced_start``). None when no grammar fits
    (an own format not in ``OWN_FORMATS``, a parameter it cannot hold)."""
    names = None if name is None else [name]
    rules = _call_rules(offered, names) if syntax is None else _own_call_rules(syntax, offered, names)
    if rules is None:
        return None
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(["start: call", *rules]))
    return None if _compiles(grammar) else OutputConstraint(grammar, prefix, "tool_choice")


_NUMBER = {"integer": r"/-?[0-9]{1,12}/", "number": r"/-?[0-9]{1,12}(\.[0-9]{1,8})?/", "boolean": '"true" | "false"'}
_PARAMETER_END = "\n</parameter>\n"


def _xml_value(schema: Any) -> str | None:
    """A lark rule body for one parameter's value as Qwen3-Coder's template writes it: a
    number, boolean or ``enum`` member as text, an object or array as compact JSON. None
    for free text: it may hold anything up to the element's end, which llguidance's greedy
    lexer cannot tell from the end itself (a value over lines, or one line starting ``</``)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) and "\n" not in v for v in enum):
        return " | ".join(_literal(v) for v in enum)
    if kind in _NUMBER:
        return _NUMBER[kind]
    if kind in ("object", "array"):
        return _json_rule(schema, lenient=True)
    return None


def _xml_call_rules(syntax: ToolSyntax, offered: Sequence[Tool], names: Sequence[str] | None) -> list[str] | None:
    """Rules for one call in Qwen3-Coder's XML format (``<function=NAME>`` then a
    ``<parameter=KEY>`` element per argument, required ones always, in the schema's order);
    None where the template's call head is unknown, a name cannot be written in it or a
    parameter takes free text (``_xml_value``).

    A call's text starts with ``tool_format.forced_start``'s (the head, the name, and the
    ``name_tail`` the template writes after it: ``>\n`` and the ``<`` of what follows)."""
    if syntax.call_head is None or not ">\n<".startswith(syntax.name_tail):
        return None
    rules, alternatives = [], []
    for i, (name, schema) in enumerate(offered):
        if names is not None and name not in names:
            continue
        properties = schema.get("properties") if isinstance(schema, dict) else None
        required = set(schema.get("required") or ()) if isinstance(schema, dict) else set()
        items = []
        for j, (key, spec) in enumerate((properties if isinstance(properties, dict) else {}).items()):
            value = _xml_value(spec)
            if value is None or set(key) & {"<", ">", "\n"}:
                return None
            rules.append(f"p{i}_{j}: {_literal(f'<parameter={key}>' + chr(10))} ({value}) {_literal(_PARAMETER_END)}")
            items.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
        head = _literal(f"{syntax.call_head}{name}>\n")
        rules.append(f"call{i}: {head} {' '.join(items)} {_literal('</function>' + chr(10) + syntax.call_end)}")
        alternatives.append(f"call{i}")
    return [f"call: {' | '.join(alternatives)}", *rules] if alternatives else None


# A model's own call formats a forced call is held to: parser module -> its rules' builder.
OWN_FORMATS = {"qwen3_coder": _xml_call_rules}


def _own_call_rules(syntax: ToolSyntax, offered: Sequence[Tool], names: Sequence[str] | None) -> list[str] | None:
    build = OWN_FORMATS.get(syntax.parser)
    return build(syntax, offered, names) if build is not None else None


def instructions(schema: dict[str, Any] | None) -> str:
    """What the system prompt says of the format (deterministic: the same schema, the same text)."""
    if schema is None:
        return "Answer with a JSON object only."
    return ("Answer with a JSON value only, matching this JSON schema:\n"
            + json.dumps(schema, ensure_ascii=False))
