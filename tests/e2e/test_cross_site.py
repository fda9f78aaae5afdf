"""No web page can drive the server: foreign Origin, foreign Host and non-JSON bodies are refused
on every route that changes state or reads history, and a refused request writes nothing."""

from __future__ import annotations

import httpx
import pytest

from support.servers import ServerProcess
from support.dbcheck import query

MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "session_id": "xs-openai"}
# (method, path, JSON body): every route that writes the store or reads history.
ROUTES = [
    ("POST", "/v1/messages", MESSAGES),
    ("POST", "/v1/messages?beta=true", MESSAGES),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/agents", {"id": "xs-agent", "system_prompt": "Be brief."}),
    ("POST", "/v1/agents/xs-victim/generate", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("DELETE", "/v1/agents/xs-victim", None),
    ("GET", "/v1/agents", None),
    ("GET", "/v1/agents/xs-victim", None),
    ("GET", "/v1/agents/xs-victim/history", None),
]


@pytest.fixture(scope="module")
def victim(server: ServerProcess) -> str:
    """An agent a hostile page would like to read or delete."""
    response = httpx.post(f"{server.url}/v1/agents", json={"id": "xs-victim", "prefill": False})
    assert response.status_code == 201, response.text
    return "xs-victim"


def store_counts(server: ServerProcess) -> tuple[int, ...]:
    return tuple(query(server.db_path, f"SELECT count(*) FROM {table}")[0][0]
                 for table in ("agents", "messages", "caches"))


def send(server: ServerProcess, method: str, path: str, body: object, **headers: str) -> httpx.Response:
    kwargs = {"json": body} if body is not None else {}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **kwargs)


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_foreign_origin_is_refused_and_writes_nothing(server: ServerProcess, victim: str, method: str, path: str,
                                                      body: object) -> None:
    before = store_counts(server)
    response = send(server, method, path, body, origin="https://evil.example")
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert "origin" in error["message"] and "allowed_origins" in error["message"]
    if path.startswith("/v1/chat"):
        assert error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "permission_error"
    assert "access-control-allow-origin" not in response.headers
    assert store_counts(server) == before
    assert httpx.get(f"{server.url}/v1/agents/{victim}").status_code == 200


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_rebound_host_is_refused(server: ServerProcess, victim: str, method: str, path: str, body: object) -> None:
    before = store_counts(server)
    response = send(server, method, path, body, host="attacker.example:8000")
    assert response.status_code == 403, response.text
    assert "host" in response.json()["error"]["message"]
    assert store_counts(server) == before


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_a_page_can_send_without_preflight_are_refused(server: ServerProcess, content_type: str) -> None:
    before = store_counts(server)
    for path, body in (("/v1/agents", b'{"id": "xs-form"}'), ("/v1/messages", httpx.Request(
            "POST", "/", json=MESSAGES).content)):
        response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": content_type})
        assert response.status_code == 415, response.text
        assert "application/json" in response.json()["error"]["message"]
    assert store_counts(server) == before


def test_local_pages_and_plain_clients_are_served(server: ServerProcess, victim: str) -> None:
    """Loopback origins (a local web UI), any port, get CORS headers; a preflight is answered."""
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8080"):
        response = httpx.get(f"{server.url}/v1/agents/{victim}", headers={"origin": origin})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
    preflight = httpx.options(f"{server.url}/v1/messages", headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,x-api-key"})
    assert preflight.status_code == 204
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "content-type,x-api-key"
    assert httpx.get(f"{server.url}/health", headers={"host": f"localhost:{server.url.rsplit(':', 1)[1]}"}) \
        .status_code == 200
    charset = httpx.post(f"{server.url}/v1/messages/count_tokens", content=httpx.Request(
        "POST", "/", json=MESSAGES).content, headers={"content-type": "application/json; charset=utf-8"})
    assert charset.status_code == 200
