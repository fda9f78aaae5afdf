"""ParsedTurn: a validated generation request, whatever protocol it came in. Pure."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Literal

from app.types import ChatMessage, SamplingParams, ToolSyntax

CacheMode = Literal["full", "prefix"]


def content_digest(role: str, text: str) -> str:
    """Identity of a message as the model sees it (role and rendered text), so a
    resent message matches its stored copy whatever JSON shape it came in
    (a string or one text block, ``cache_control`` markers anywhere)."""
    return hashlib.sha256(f"{role}\0{text}".encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Completion:
    """A raw prompt to continue (``POST /v1/completions``): no chat template; ``suffix``: the
    text after the gap, for fill-in-the-middle."""

    prompt: str
    suffix: str | None = None


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    stream: bool
    session_id: str | None  # named by the body (metadata.user_id / session_id)
    raw_messages: tuple[dict[str, Any], ...]  # as received, for history
    include_usage: bool = False  # OpenAI stream_options.include_usage
    parse_tools: bool = False  # tools were offered: look for tool calls in the reply
    parse_thinking: bool = False  # thinking was asked for: a leading <think> block is reasoning
    prefill: str = ""  # the client's start of the reply (a final assistant message): in the prompt, not echoed
    reply_prefix: str = ""  # our start of the reply (a forced tool call): in the prompt, parsed as the reply
    ttl_seconds: int | None = None  # how long the agent's conversation caches are kept (OpenAI ``ttl``); 0: not on disk
    hot_ttl_seconds: int | None = None  # Anthropic ``cache_control`` hint: how long to keep it in memory
    cache_mode: CacheMode = "full"  # OpenAI ``cache_mode``: "prefix" reuses whole shared blocks only
    # What identifies the conversation (history by content): a digest of what the prompt
    # holds besides the messages (system field, tools), and one per raw message.
    system_digest: str = ""
    message_digests: tuple[str, ...] = ()
    # The prompt's pieces in order, (label, text): "system", "tools", "messages.N". Where
    # a cache match ends is reported as the piece it falls in (cache-miss diagnostics).
    parts: tuple[tuple[str, str], ...] = ()
    # A snapshot closing the system prompt that the conversation keeps from its first
    # request (Claude Code's git status; app.protocol.claude_code). "" if none.
    snapshot: str = ""
    # The served model's own tool format (None: the generic text format) and, in it, the
    # tools offered as its chat template takes them (app.protocol.tool_format).
    tool_syntax: ToolSyntax | None = None
    tool_specs: tuple[dict[str, Any], ...] = ()
    # The tools offered, in either format: a reply's call written as plain JSON names one of
    # them (app.protocol.loose_calls).
    offered_tools: tuple[dict[str, Any], ...] = ()
    # What one protocol's renderers need beyond the above (the Responses API: its tools'
    # kinds and namespaces, the request fields its response object repeats).
    details: Any = None
    completion: Completion | None = None  # a raw prompt (``messages`` empty): not a chat

    def with_snapshot(self, pinned: str | None) -> ParsedTurn:
        """The turn rendered with the conversation's pinned snapshot instead of this request's."""
        if not self.snapshot or not pinned or pinned == self.snapshot:
            return self
        system = self.messages[0]
        assert system.role == "system" and self.snapshot in system.content
        messages = (ChatMessage("system", system.content.replace(self.snapshot, pinned, 1)), *self.messages[1:])
        parts = tuple((label, text.replace(self.snapshot, pinned, 1) if label == "system" else text)
                      for label, text in self.parts)
        return replace(self, messages=messages, parts=parts, snapshot=pinned)


def locate_part(parts: tuple[tuple[str, str], ...], text: str, offset: int) -> str:
    """Which piece of the rendered prompt ``text`` character ``offset`` falls in:
    a label of ``parts`` (found in order), or "template" between them (role
    markers and separators the chat template adds)."""
    cursor = 0
    for label, part in parts:
        at = text.find(part, cursor)
        if at < 0:
            continue
        if offset < at:
            return "template"
        if offset < at + len(part):
            return label
        cursor = at + len(part)
    return "template"
