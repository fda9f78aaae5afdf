"""Malformed requests get Anthropic-shaped 400s naming the field, and no successful row."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from support.servers import ServerProcess
from support.dbcheck import query, request_row

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
    ("too many stop sequences", {**OK, "stop_sequences": [f"s{i}" for i in range(17)]},
     "stop_sequences: List should have at most 16 items"),
    ("a very long stop sequence", {**OK, "stop_sequences": ["x" * 1000]}, "stop_sequences.0: String should have at most"),
    ("cache_control ttl as a list", {**OK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": ["1h"]}}]}]},
     "messages.0.content.0.cache_control.ttl"),
    ("a prompt far beyond the context", {**OK, "messages": [{"role": "user", "content": "lorem ipsum " * 300_000}]},
     "prompt is too long:"),
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


def store(server: ServerProcess) -> tuple[int, ...]:
    return tuple(query(server.db_path, f"SELECT count(*) FROM {t}")[0][0] for t in ("agents", "conversations", "messages"))


@pytest.mark.parametrize("raw", [b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                 b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}'],
                         ids=["deep nesting", "lone surrogate"])
def test_hostile_json_is_a_400_not_a_500(server: ServerProcess, raw: bytes) -> None:
    before = store(server)
    response = httpx.post(f"{server.url}/v1/messages", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert store(server) == before


@pytest.mark.parametrize("headers, body, field", [
    ({"x-session-id": "a/b"}, {}, "X-Session-ID"),
    ({"x-claude-code-session-id": "x" * 129}, {}, "X-Claude-Code-Session-Id"),
    ({}, {"metadata": {"user_id": '{"session_id": "bad id with spaces"}'}}, "metadata.user_id.session_id"),
])
def test_session_ids_are_validated_and_nothing_is_written(server: ServerProcess, headers: dict, body: dict,
                                                          field: str) -> None:
    before = store(server)
    response = httpx.post(f"{server.url}/v1/messages", json={**OK, **body}, headers=headers, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(field)
    assert store(server) == before


def test_openai_limits(server: ServerProcess) -> None:
    chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for extra, field in (({"ttl": 2**63}, "ttl"), ({"stop": [str(i) for i in range(17)]}, "stop"),
                         ({"session_id": "no spaces allowed"}, "session_id")):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["message"].startswith(field)


def test_odd_but_valid_requests_are_served(server: ServerProcess) -> None:
    """A top_k beyond the vocabulary means no top-k filter; a tool schema of an unexpected
    shape is offered as far as it can be read."""
    weird_tool = {"name": "t", "input_schema": {"type": "object", "properties": ["not", "an", "object"],
                                                "required": "city"}}
    for extra in ({"top_k": 10**6}, {"tools": [weird_tool]}):
        response = httpx.post(f"{server.url}/v1/messages", json={**OK, **extra}, timeout=120)
        assert response.status_code == 200, (extra, response.text)
