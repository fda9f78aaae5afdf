"""A model's own tool-call format, found in its chat template as ``mlx_lm.server`` finds it.

mlx-lm picks a parser of ``mlx_lm.tool_parsers`` for a tokenizer when it loads it
(``tool_parser_type`` in ``tokenizer_config.json``, else inferred from the markers the
chat template writes); the ``TokenizerWrapper`` holds it with the call's start and end
markers. A model gets its own format here when it has such a parser and its template
defines tools (refers to ``tools``); any other keeps the generic text format.

What the template writes before a called tool's name and between the name and its
arguments (``ToolSyntax.call_head``, ``name_tail``) is found by rendering probe calls
through it: a forced tool call starts the reply with exactly that, so the next turn's
prompt, which renders the call through the template, continues the text of this one.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from app.engine.prompting import template_call_id
from app.types import ToolSyntax

log = logging.getLogger(__name__)

PROBE = "semantic_probe_tool"
PROBE_KEY = "semantic_probe_argument"
_TOOLS = re.compile(r"\btools\b")


def _template_texts(tokenizer: Any) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use")
        return [t for t in template.values() if isinstance(t, str)]
    return [template] if isinstance(template, str) else []


def _render_call(tokenizer: Any, arguments: dict[str, Any]) -> tuple[str, str]:
    """(the prompt for a reply, that prompt followed by a probe call with ``arguments``)."""
    spec = {"type": "function", "function": {"name": PROBE, "description": "A probe.", "parameters": {
        "type": "object", "properties": {PROBE_KEY: {"type": "string"}}}}}
    asked = [{"role": "user", "content": "Call the probe."}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": template_call_id(PROBE), "type": "function", "function": {"name": PROBE, "arguments": arguments}}]}
    prompt = tokenizer.apply_chat_template(asked, tools=[spec], tokenize=False, add_generation_prompt=True)
    called = tokenizer.apply_chat_template([*asked, call], tools=[spec], tokenize=False, add_generation_prompt=False)
    return prompt, called


def call_shape(tokenizer: Any, call_start: str) -> tuple[str | None, str]:
    """What the template writes from the generation prompt to a call's tool name, and from
    the name to where the arguments start (what a call without arguments and one with
    an argument share). (None, "") when a call does not continue the generation prompt
    or the start marker is not before the name."""
    try:
        prompt, bare = _render_call(tokenizer, {})
        _, with_argument = _render_call(tokenizer, {PROBE_KEY: "x"})
    except Exception as exc:  # noqa: BLE001 - any template, any error: no shape known
        log.info("chat template did not render a probe tool call (%s); forced calls force its start marker", exc)
        return None, ""
    if not (bare.startswith(prompt) and with_argument.startswith(prompt)) or PROBE not in bare[len(prompt):]:
        return None, ""
    at = bare.index(PROBE, len(prompt))
    head = bare[len(prompt):at]
    if call_start not in head or not with_argument.startswith(bare[:at + len(PROBE)]):
        return None, ""
    tail = os.path.commonprefix([bare[at + len(PROBE):], with_argument[at + len(PROBE):]])
    return head, tail


def tool_syntax(tokenizer: Any) -> ToolSyntax | None:
    """The tokenizer's own tool format (an ``mlx_lm`` ``TokenizerWrapper``), or None when
    its template defines no tools or mlx-lm has no parser for it."""
    if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
        return None
    if not any(_TOOLS.search(text) for text in _template_texts(tokenizer)):
        return None
    parser = str(tokenizer.init_kwargs.get("tool_parser_type", "unknown"))
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
    head, tail = call_shape(tokenizer, start)
    return ToolSyntax(parser, start, end, head, tail, tokenizer.tool_parser)
