"""Reading a JSON request body into a value, with protocol-shaped errors."""

from __future__ import annotations

import json
from typing import Any

import falcon

from app.errors import InvalidRequest


def read_json(req: falcon.Request) -> Any:
    """The decoded JSON body.

    Raises:
        InvalidRequest: the body is empty, not UTF-8 or not valid JSON.
    """
    raw = req.bounded_stream.read()
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object", "body")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", "body") from None
