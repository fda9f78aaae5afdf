"""The prompt transformations that keep Claude Code's prompts stable (app.protocol.claude_code),
each on the shape the real CLI 2.1.197 sends, and each off with ``stable_prompts`` false."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from app.protocol import anthropic
from app.protocol.claude_code import split_system
from app.types import RequestOptions

ON, OFF = RequestOptions(), RequestOptions(stable_prompts=False)
INSTRUCTIONS = "You are an interactive agent that helps users with software engineering tasks.\n\n# Doing tasks\nBe brief."
MEMORY = ("\n# auto memory\n\nYou have a persistent, file-based memory system at `/home/u/.claude/memory/`.\n"
          "## Types of memory\nuser, feedback, project.\n")
ENVIRONMENT = "\n# Environment\n - Primary working directory: /work\n - Is a git repository: true"
GIT = ("\n\ngitStatus: This is the git status at the start of the conversation. Note that this status is a snapshot "
       "in time, and will not update during the conversation.\n\nCurrent branch: main\n\nStatus:\n{status}\n\n"
       "Recent commits:\neabbf7b first")
TOOLS = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}},
         {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}}]


def body(status: str = "(clean)", tools: list[dict[str, Any]] = TOOLS, billing: str = "8a5") -> dict[str, Any]:
    return {"model": "claude-sonnet-5", "max_tokens": 64, "tools": tools,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{billing}; "
                                                "cc_entrypoint=sdk-cli;"},
                       {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK."},
                       {"type": "text", "text": INSTRUCTIONS + MEMORY + ENVIRONMENT + GIT.format(status=status),
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "List the files here"}]}


def system_of(options: RequestOptions, **changes: Any) -> str:
    return anthropic.parse_request(body(**changes), options).messages[0].content


def test_the_billing_header_is_dropped() -> None:
    assert "x-anthropic-billing-header" not in system_of(ON)
    assert system_of(ON, billing="000") == system_of(ON, billing="8a5")
    assert "x-anthropic-billing-header" in system_of(OFF)


def test_tools_are_rendered_in_one_order() -> None:
    flipped = list(reversed(TOOLS))
    assert system_of(ON, tools=flipped) == system_of(ON)
    assert anthropic.parse_request(body(tools=flipped), ON).system_digest == anthropic.parse_request(body(), ON).system_digest
    assert system_of(OFF, tools=flipped) != system_of(OFF)


def test_a_new_git_status_is_the_same_conversation_rendered_with_its_first_snapshot() -> None:
    first = anthropic.parse_request(body("(clean)"), ON)
    later = anthropic.parse_request(body("?? b.txt"), ON)
    assert first.system_digest == later.system_digest  # the same conversation
    assert first.snapshot.endswith("eabbf7b first") and "(clean)" in first.snapshot
    pinned = later.with_snapshot(first.snapshot)
    assert pinned.messages == first.messages  # rendered exactly as the first request was
    assert dict(pinned.parts)["system"] == dict(first.parts)["system"]
    assert later.with_snapshot(None) is later  # a new conversation renders (and pins) its own
    off_first, off_later = (anthropic.parse_request(body(s), OFF) for s in ("(clean)", "?? b.txt"))
    assert off_first.system_digest != off_later.system_digest and not off_first.snapshot


def test_fitting_drops_only_the_auto_memory_section_and_keeps_the_conversation() -> None:
    whole = anthropic.parse_request(body(), ON)
    fitted = anthropic.parse_request(body(), replace(ON, fit=True))
    assert "# auto memory" in whole.messages[0].content and "# auto memory" not in fitted.messages[0].content
    assert "# Doing tasks" in fitted.messages[0].content and "# Environment" in fitted.messages[0].content
    assert fitted.system_digest == whole.system_digest and fitted.message_digests == whole.message_digests
    assert split_system("no sections here", fit=True).stable == "no sections here"
