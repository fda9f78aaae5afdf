"""Which agent a request belongs to, from what the client sent. Pure.

Order (SPEC "Agent identity"): the direct API's URL id; OpenAI ``session_id`` /
``X-Session-ID``; Anthropic ``X-Claude-Code-Session-Id``, the ``session_id``
inside ``metadata.user_id``, or ``X-Session-ID``. Without any of these a new
agent is created (content-based resumption arrives with the cache).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True, slots=True)
class AgentKey:
    agent_id: str
    origin: str  # direct / openai / anthropic / content


def anthropic_agent(headers: Mapping[str, str], metadata_session: str | None) -> AgentKey:
    """Resolve the agent of an Anthropic Messages request.

    ``headers`` must be keyed in upper case (as Falcon presents them).
    """
    for candidate in (headers.get("X-CLAUDE-CODE-SESSION-ID"), metadata_session, headers.get("X-SESSION-ID")):
        if candidate:
            return AgentKey(candidate, "anthropic")
    return AgentKey(f"agent-{uuid.uuid4().hex}", "content")
