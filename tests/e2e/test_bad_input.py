"""Malformed requests get Anthropic-shaped 400s naming the field, and no successful row."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from conftest import ServerProcess
from support.dbcheck import request_row

OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in OK.items() if k != key}


CASES: list[tuple[str, Any, str]] = [
    ("missing model", without("model"), "model: Field required"),
    ("missing messages", without("messages"), "messages: Field required"),
    ("missing max_tokens", without("max_tokens"), "max_tokens: Field required"),
    ("empty messages", {**OK, "messages": []}, "messages: List should have at least 1 item"),
    ("messages not a list", {**OK, "messages": {"role": "user"}}, "messages: Input should be a valid list"),
    ("unknown role", {**OK, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role: Input should be"),
    ("content missing", {**OK, "messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ("content wrong type", {**OK, "messages": [{"role": "user", "content": 42}]}, "messages.0.content:"),
    ("text block without text", {**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text: Field required"),
    ("max_tokens as string", {**OK, "max_tokens": "8"}, "max_tokens: Input should be a valid integer"),
    ("max_tokens zero", {**OK, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ("huge max_tokens", {**OK, "max_tokens": 10**15}, "max_tokens: 1000000000000000 > 131072"),
    ("temperature out of range", {**OK, "temperature": 2.5}, "temperature: Input should be less than or equal to 1"),
    ("image for a text model", {**OK, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages.0.content.0: image content is not supported"),
    ("body is a list", [OK], "body: Input should be a valid dictionary"),
]


@pytest.mark.parametrize("name, body, message", CASES, ids=[c[0] for c in CASES])
def test_malformed_body(server: ServerProcess, name: str, body: Any, message: str) -> None:
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(message), error["error"]["message"]
    assert request_row(server.db_path, response.headers["request-id"])["status"] == "rejected"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"null"])
def test_unparseable_body(server: ServerProcess, raw: bytes) -> None:
    response = httpx.post(f"{server.url}/v1/messages", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert request_row(server.db_path, response.headers["request-id"])["status"] == "rejected"


def test_unknown_route_and_method_use_the_error_shape(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    response = httpx.put(f"{server.url}/v1/messages")
    assert response.status_code == 405 and response.json()["type"] == "error"
