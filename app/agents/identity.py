"""Which agent a request belongs to, from what the client sent. Pure.

Order (SPEC "Agent identity"): the direct API's URL id; OpenAI (and Ollama) ``session_id`` /
``X-Session-ID``; Anthropic ``X-Claude-Code-Session-Id``, the ``session_id``
inside ``metadata.user_id``, or ``X-Session-ID``; the Responses API: Codex's
``session-id`` or ``X-Session-ID`` (or the agent of ``previous_response_id``).
Without any of these a new agent's conversation is recognised by content (the
agent service), or a new agent is created.

A client may also name the thread a request belongs to, under the agent: Codex's
``thread-id`` (a subagent's own; with ``x-openai-subagent`` for a review, a
compaction or a title request), Claude Code's ``x-claude-code-agent-id`` on a
subagent. A named thread is its own conversation: a side request never continues
(and so never evicts) the main thread's.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from app.errors import InvalidRequest
from app.types import SESSION_ID_PATTERN

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
# How an agent came to be known: the API that named it, or its content ("imported": an agent
# known by its content where it was exported, imported here, so never matched by content
# here: its message digests came from the archive; app/agents/portable.py).
ORIGINS = frozenset({"direct", "openai", "anthropic", "responses", "ollama", "content", "imported"})


@dataclass(frozen=True, slots=True)
class AgentKey:
    agent_id: str
    origin: str  # one of ORIGINS
    thread: str | None = None  # the client's thread under the agent (None: recognised by content)


def anthropic_agent(headers: Mapping[str, str], metadata_session: str | None) -> AgentKey | None:
    """The agent an Anthropic Messages request names, if it names one.

    ``headers`` must be keyed in upper case (as Falcon presents them). None
    means: resolve by content, else create a new agent (``new_agent``).
    """
    subagent = headers.get("X-CLAUDE-CODE-AGENT-ID")
    thread = _checked(subagent, "X-Claude-Code-Agent-Id") if subagent else None
    for where, candidate in (("X-Claude-Code-Session-Id", headers.get("X-CLAUDE-CODE-SESSION-ID")),
                             ("metadata.user_id.session_id", metadata_session),
                             ("X-Session-ID", headers.get("X-SESSION-ID"))):
        if candidate:
            return AgentKey(_checked(candidate, where), "anthropic", thread)
    return None


def openai_agent(headers: Mapping[str, str], body_session: str | None, origin: str = "openai") -> AgentKey | None:
    """The agent an OpenAI request names: ``session_id`` in the body, else ``X-Session-ID``
    (the Ollama API names it the same way, ``origin`` "ollama")."""
    for where, candidate in (("session_id", body_session), ("X-Session-ID", headers.get("X-SESSION-ID"))):
        if candidate:
            return AgentKey(_checked(candidate, where), origin)
    return None


def responses_agent(headers: Mapping[str, str]) -> AgentKey | None:
    """The agent and thread a Responses API request names (Codex's headers), if it names one.

    ``session-id`` is shared by a root thread, its subagents and its side requests: the
    agent. The thread is ``thread-id`` (else ``child-of:<x-codex-parent-thread-id>``),
    followed by ``/<x-openai-subagent>`` for a side request (``review``, ``compact``, ...).
    """
    parts = {name: _checked(value, name) for name in ("session-id", "X-Session-ID", "thread-id",
                                                      "x-codex-parent-thread-id", "x-openai-subagent")
             if (value := headers.get(name.upper()))}
    thread = parts.get("thread-id") or (f"child-of:{parts['x-codex-parent-thread-id']}"
                                        if "x-codex-parent-thread-id" in parts else None)
    if "x-openai-subagent" in parts:
        thread = f"{thread or ''}/{parts['x-openai-subagent']}"
    agent = parts.get("session-id") or parts.get("X-Session-ID") or parts.get("thread-id")
    return AgentKey(agent, "responses", thread) if agent else None


def _checked(session_id: str, where: str) -> str:
    """A session id is a lookup key: letters, digits and ``._:-``, at most 128 characters."""
    if not _SESSION_ID.fullmatch(session_id):  # match() would let "$" pass a trailing newline
        raise InvalidRequest(f"{where}: a session id is 1 to 128 letters, digits or ._:- characters", where)
    return session_id


def new_agent() -> AgentKey:
    return AgentKey(f"agent-{uuid.uuid4().hex}", "content")
