"""The direct agent API's generation requests (``POST /v1/agents/{id}/generate``). Pure.

The server keeps the history; a client sends only the new messages. A turn is an
Anthropic Messages request (``app.protocol.anthropic`` parses it): the agent's system
prompt, the stored messages of the conversation it continues replayed in that API's
shape, then the new messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from app.errors import InvalidRequest

# A generate request's fields passed on to the Messages request as they are.
SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "metadata",
                   "tools", "tool_choice", "thinking", "speculate", "output_format", "output_config", "mcp_servers",
                   "container")

_BLOCK_TYPES = {"text", "tool_use", "tool_result"}


def starts_conversation(new: dict[str, Any]) -> bool:
    """Whether a generate request starts a new conversation (``"new_conversation": true``)
    instead of continuing the agent's latest one.

    Raises:
        InvalidRequest: no new messages, or ``new_conversation`` not a boolean.
    """
    if not isinstance(new.get("messages"), list) or not new["messages"]:
        raise InvalidRequest("messages: a non-empty list of the new messages is required", "messages")
    fresh = new.get("new_conversation", False)
    if not isinstance(fresh, bool):
        raise InvalidRequest("new_conversation: expected a boolean", "new_conversation")
    return fresh


def refuse_foreign(agent_id: str, protocols: set[str]) -> None:
    """400 naming why, when the conversation a direct turn would continue was written through
    another API. A direct turn can rebuild only its own conversations: the Anthropic API's
    system prompt and tools, the Responses API's instructions and parts, and the OpenAI and
    Ollama APIs' tools are kept as digests only, and their system messages and tool turns
    have no direct-API shape, so replaying them would silently send the model another prompt."""
    foreign = sorted(protocols - {"direct"})
    if foreign:
        raise InvalidRequest(
            f"agent {agent_id!r}: its latest conversation was made through the {foreign[0]} API, whose system "
            "prompt, tools and message parts a direct turn cannot rebuild; continue it through that API",
            "messages")


def replay(stored: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Stored direct-API messages, ``(role, content)`` in order, as the direct API's messages
    take them (Anthropic's): content blocks other than text, tool use and tool results left
    out, and messages left without content or not the user's or the assistant's (system
    text: the agent's system prompt applies)."""
    messages = []
    for role, content in stored:
        if isinstance(content, list):
            content = [part for part in content if isinstance(part, dict) and part.get("type") in _BLOCK_TYPES]
        if role in ("user", "assistant") and content:
            messages.append({"role": role, "content": content})
    return messages


def request_body(new: dict[str, Any], history: list[dict[str, Any]], system_prompt: str | None,
                 default_max_tokens: int) -> dict[str, Any]:
    """The Messages request of a generate request ``new``: its sampling fields, the agent's
    ``system_prompt``, and its messages after ``history`` (``replay``'s)."""
    body = {k: new[k] for k in SAMPLING_FIELDS if k in new}
    body.setdefault("model", "default")
    body.setdefault("max_tokens", default_max_tokens)
    if system_prompt:
        body["system"] = system_prompt
    body["messages"] = history + new["messages"]
    return body
