"""What of the Codex CLI's prompt is optional when it does not fit a small model's context. Pure.

Found by recording the real CLI (0.169.0; tests/support/codex_recorder.py). Its first
request is ~9,400 SmolLM2 tokens as JSON: 4,300 of them are tool schemas, which the
generic tool format (``app.protocol.tools``) renders in ~1,000, so the request fits
SmolLM2's 8,192-token context as ~5,700. Within a session nothing in the prompt changes
between requests (every turn resends the same items, ``codex exec resume`` included),
so, unlike Claude Code's, nothing needs making stable.

Optional, dropped only when a prompt exceeds the model's context (``fit_prompts``,
like Claude Code's auto memory section): the developer message listing the installed
skills (``<skills_instructions>``, ~600 tokens) and the sections of Codex's base
instructions about how to word progress updates and the final answer (~1,900 tokens).
What the agent must do (task execution, validation, AGENTS.md, tool guidelines) stays.
"""

from __future__ import annotations

import re

SKILLS_START = "<skills_instructions>"
# Headings of the base instructions' optional sections (each up to the next heading of its level or higher).
OPTIONAL_SECTIONS = ("## Responsiveness", "## Ambition vs. precision", "## Sharing progress updates",
                     "## Presenting your work and final message")
_HEADING = re.compile(r"^(#{1,6}) ", re.MULTILINE)


def is_optional_message(text: str) -> bool:
    """A developer message that may be left out whole (the skills list)."""
    return text.lstrip().startswith(SKILLS_START)


def drop_optional_sections(text: str) -> str:
    """``text`` without the optional sections of Codex's instructions (unchanged if it has none)."""
    for heading in OPTIONAL_SECTIONS:
        start = text.find(f"\n{heading}\n")
        if start < 0:
            continue
        level = len(heading) - len(heading.lstrip("#"))
        end = len(text)
        for match in _HEADING.finditer(text, start + len(heading) + 2):
            if len(match.group(1)) <= level:
                end = match.start() - 1  # keep the newline before the next heading
                break
        text = text[:start] + text[end:]
    return text
