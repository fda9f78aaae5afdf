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
    return parse_json(req.bounded_stream.read())


def parse_json(raw: bytes | str) -> Any:
    """``raw`` decoded as a request body (a WebSocket message's text is one).

    Raises:
        InvalidRequest: it is empty, not UTF-8 or not valid JSON.
    """
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object", "body")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", "body") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", "body") from None
    escape = "\\u" if isinstance(raw, str) else b"\\u"
    if escape in raw and _has_lone_surrogate(body):  # type: ignore[operator]  # only a \u escape can make one
        raise InvalidRequest("request body has an unpaired UTF-16 surrogate (\\ud800-\\udfff) in a string", "body")
    return body


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
