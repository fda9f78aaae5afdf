"""What Claude Code puts in its prompts that changes between requests without changing the
conversation, and what is optional when a prompt does not fit. Pure.

Found by recording the real CLI (2.1.197; tests/support/claude_recorder.py) and reading
where consecutive prompts part (the cache-miss diagnostics). Within one session, a
headless session's prompts only grow, except for:

- the ``x-anthropic-billing-header`` system block: a hash that differs per session and
  CLI version, billing metadata rather than instructions. Dropped.
- the ``gitStatus:`` snapshot closing the system prompt: re-read by every CLI run, so a
  ``claude -c`` after any file change rewrites the system prompt and every cached token
  after it. The snapshot says of itself that it is "the git status at the start of the
  conversation ... will not update during the conversation", so the server keeps the
  conversation's first snapshot (pinned on the conversation) and renders that one.
- the order of ``tools``: rendered sorted by name, so an MCP server listing its tools in
  another order does not change the prompt.

(``cache_control`` markers moving, and a block list resent as a plain string, change
the JSON but not the rendered prompt; the date line in the first message's
``<system-reminder>`` changes only between sessions, after the system prompt and tools.)

With ``stable_prompts`` off none of this is done. Optional: when a prompt exceeds the
model's context, the ``# auto memory`` section of the system prompt (about 2,900 tokens
of instructions for a memory directory) is dropped rather than refusing the request
(``fit_prompts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
GIT_STATUS_START = "\n\ngitStatus: "
AUTO_MEMORY_START = "\n# auto memory\n"
SECTION_START = "\n# "


def drop_billing_header(texts: list[str]) -> list[str]:
    """System block texts without Claude Code's billing metadata."""
    kept = [t for t in texts if not t.startswith(BILLING_HEADER_PREFIX)]
    if len(kept) != len(texts):
        log.info("dropped %d x-anthropic-billing-header system block(s) from the prompt", len(texts) - len(kept))
    return kept


def canonical_tools(tools: list[Any]) -> list[Any]:
    """Tools in a stable order (by name)."""
    return sorted(tools, key=lambda tool: str(getattr(tool, "name", "")))


@dataclass(frozen=True, slots=True)
class SystemParts:
    """A system prompt split into what identifies the conversation and what does not."""

    stable: str  # the text that identifies the conversation (digested)
    snapshot: str  # the gitStatus snapshot closing it ("" if none), rendered after ``stable``


def split_system(text: str, fit: bool) -> SystemParts:
    """Separate the git status snapshot (and, with ``fit``, drop the auto memory section)."""
    at = text.find(GIT_STATUS_START)
    stable, snapshot = (text[:at], text[at:]) if at >= 0 else (text, "")
    if fit:
        stable = drop_auto_memory(stable)
    return SystemParts(stable, snapshot)


def drop_auto_memory(text: str) -> str:
    start = text.find(AUTO_MEMORY_START)
    if start < 0:
        return text
    end = text.find(SECTION_START, start + len(AUTO_MEMORY_START))
    return text[:start] + (text[end:] if end >= 0 else "")
