"""Which agent a request belongs to, from what the client sent. Pure.

Order (SPEC "Agent identity"): the direct API's URL id; OpenAI ``session_id`` /
``X-Session-ID``; Anthropic ``X-Claude-Code-Session-Id``, the ``session_id``
inside ``metadata.user_id``, or ``X-Session-ID``. Without any of these a new
agent's conversation is recognised by content (the agent service), or a new
agent is created.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Mapping

from app.errors import InvalidRequest
from app.types import SESSION_ID_PATTERN

_SESSION_ID = re.compile(SESSION_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class AgentKey:
    agent_id: str
    origin: str  # direct / openai / anthropic / content


def anthropic_agent(headers: Mapping[str, str], metadata_session: str | None) -> AgentKey | None:
    """The agent an Anthropic Messages request names, if it names one.

    ``headers`` must be keyed in upper case (as Falcon presents them). None
    means: resolve by content, else create a new agent (``new_agent``).
    """
    for where, candidate in (("X-Claude-Code-Session-Id", headers.get("X-CLAUDE-CODE-SESSION-ID")),
                             ("metadata.user_id.session_id", metadata_session),
                             ("X-Session-ID", headers.get("X-SESSION-ID"))):
        if candidate:
            return AgentKey(_checked(candidate, where), "anthropic")
    return None


def openai_agent(headers: Mapping[str, str], body_session: str | None) -> AgentKey | None:
    """The agent an OpenAI request names: ``session_id`` in the body, else ``X-Session-ID``."""
    for where, candidate in (("session_id", body_session), ("X-Session-ID", headers.get("X-SESSION-ID"))):
        if candidate:
            return AgentKey(_checked(candidate, where), "openai")
    return None


def _checked(session_id: str, where: str) -> str:
    """A session id is a lookup key: letters, digits and ``._:-``, at most 128 characters."""
    if not _SESSION_ID.match(session_id):
        raise InvalidRequest(f"{where}: a session id is 1 to 128 letters, digits or ._:- characters", where)
    return session_id


def new_agent() -> AgentKey:
    return AgentKey(f"agent-{uuid.uuid4().hex}", "content")
