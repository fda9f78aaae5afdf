"""ParsedTurn: a validated generation request, whatever protocol it came in. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from app.types import ChatMessage, SamplingParams

CacheMode = Literal["full", "prefix"]


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
    ttl_seconds: int | None = None  # how long the agent's cache is kept (OpenAI ``ttl``); 0: not on disk
    hot_ttl_seconds: int | None = None  # Anthropic ``cache_control`` hint: how long to keep it in memory
    cache_mode: CacheMode = "full"  # OpenAI ``cache_mode``: "prefix" reuses whole shared blocks only

    @property
    def reply_start(self) -> str:
        """What the prompt holds after the template's generation prompt."""
        return self.prefill + self.reply_prefix
