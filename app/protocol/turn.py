"""ParsedTurn: a validated generation request, whatever protocol it came in. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.types import ChatMessage, SamplingParams


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
