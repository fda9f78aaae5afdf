"""An agent's log in its archive (``portable.py``): its request rows and its stored Responses
API objects, out to ``agent.json`` and back into a store.

They travel with the agent so that its statistics and a client's ``previous_response_id``
continue where it lands. Rows keep their ids (a Responses client names them); one whose id
the store already holds (the source is still there: an agent copied ``--as`` another id
inside its own pool) stays its owner's, and the imported agent goes without it. Every value
of an archive is checked against its column's type and length before it is written, and the
agent and conversation a row names are the import's, never the archive's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import InvalidRequest
from app.store import history, responses
from app.store.models import Base, Request, StoredResponse


@dataclass(frozen=True, slots=True)
class ImportedLog:
    requests: frozenset[str]  # the request ids written (a message keeps its link to those only)
    n_responses: int
    n_skipped: int  # rows whose id this store held already


def export_log(session: Session, agent_id: str) -> dict[str, list[dict[str, Any]]]:
    """The agent's request rows and stored responses, oldest first, as ``agent.json`` holds them."""
    requests = session.scalars(select(Request).where(Request.agent_id == agent_id)
                               .order_by(Request.created_at, Request.id))
    responses = session.scalars(select(StoredResponse).where(StoredResponse.agent_id == agent_id)
                                .order_by(StoredResponse.created_at, StoredResponse.id))
    return {"requests": [_values(row) for row in requests], "responses": [_values(row) for row in responses]}


def import_log(session: Session, manifest: dict[str, Any], agent_id: str,
               conversations: dict[str, str]) -> ImportedLog:
    """Add the archive's request rows and stored responses to ``agent_id``, in the caller's
    transaction, after its conversations (``conversations``: the archive's id -> the new one).

    Raises:
        InvalidRequest: a value of the wrong type or length, or a response of a conversation
            the archive does not hold.
    """
    listed = [_checked(Request, data, {"agent_id": agent_id,
                                       "conversation_id": conversations.get(str(data.get("conversation_id")))})
              for data in _listed(manifest, "requests")]
    requests = history.import_requests(session, listed)  # flushed: messages and responses point to them
    stored = []
    for data in _listed(manifest, "responses"):
        conversation = conversations.get(str(data.get("conversation_id")))
        if conversation is None:
            raise InvalidRequest("archive: a stored response names a conversation it does not hold", "archive")
        values = _checked(StoredResponse, data, {
            "agent_id": agent_id, "conversation_id": conversation,
            "request_id": data.get("request_id") if data.get("request_id") in requests else None})
        if values["n_messages"] is None or values["n_messages"] < 0 or not isinstance(values["body"], dict):
            raise InvalidRequest("archive: a stored response lacks its message count or its body", "archive")
        stored.append(values)
    n_responses = responses.import_responses(session, stored)
    return ImportedLog(requests, n_responses, len(listed) - len(requests) + len(stored) - n_responses)


def _values(row: Base) -> dict[str, Any]:
    return {column.name: value.isoformat() if isinstance(value := getattr(row, column.key), datetime) else value
            for column in row.__table__.columns}


def _listed(manifest: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """``manifest[key]``, a list of objects (absent: an archive written before they travelled)."""
    rows = manifest.get(key, [])
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise InvalidRequest(f"archive: agent.json's {key} is not a list of objects", "archive")
    return rows


def _checked(model: type[Base], data: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """A row's column values from ``data``, each of its column's type (and within its length),
    and ``fixed`` over them."""
    values: dict[str, Any] = {}
    for column in model.__table__.columns:
        if column.name in fixed:
            values[column.key] = fixed[column.name]
            continue
        value = data.get(column.name)
        if value is not None:
            value = _typed(value, column.type.python_type, getattr(column.type, "length", None),
                           f"{model.__tablename__}.{column.name}")
        values[column.key] = value
    if not isinstance(values.get("id"), str) or not values["id"]:
        raise InvalidRequest(f"archive: a row of {model.__tablename__} has no id", "archive")
    return values


def _typed(value: Any, kind: type, length: int | None, name: str) -> Any:
    ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) \
        or (kind is float and isinstance(value, int) and not isinstance(value, bool)) or kind is datetime
    if not ok:
        raise InvalidRequest(f"archive: {name} is not a {kind.__name__}", "archive")
    if kind is datetime:
        try:
            return datetime.fromisoformat(str(value))
        except ValueError:
            raise InvalidRequest(f"archive: {name} {str(value)[:40]!r} is not a time", "archive") from None
    if kind is str and length is not None and len(value) > length:
        raise InvalidRequest(f"archive: {name} is longer than {length} characters", "archive")
    return float(value) if kind is float else value
