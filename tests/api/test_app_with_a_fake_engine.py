"""The API layer alone: routing, errors and admission against a fake engine (no model, no MLX),
through falcon's TestClient, with the real store. The real engine behind the same surface is
tested end to end in tests/e2e."""

from __future__ import annotations

import inspect
import json
import logging
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path

import falcon.testing
import pytest

from app import status
from app.agents.service import AgentService
from app.api.routes import Deps
from app.engine.surface import EngineSurface, GenerationJob
from app.engine.timing import PrefillProgress
from app.errors import Overloaded, QueueTimeout, TooLargeForMemory
from app.main import create_app
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import (GenerationRequest, ReuseReport,
                       SamplingParams)
from support.dbcheck import query
from support.fake_engine import FakeEngine, make_app


def test_the_fake_engine_and_the_engine_have_the_surface_the_api_sees(tmp_path: Path) -> None:
    """Both implement ``EngineSurface``: every member, methods with the parameters it declares.
    (The one test here that imports the real engine, and so MLX: skipped where MLX is not,
    tests/unit/test_api_tier_without_mlx.py.)"""
    pytest.importorskip("mlx.core", reason="the real Engine imports MLX")
    from app.engine.engine import Engine

    fake = FakeEngine(tmp_path)
    job = fake.submit(GenerationRequest("r", fake.render(()), SamplingParams(max_tokens=1)))
    assert isinstance(fake, EngineSurface) and isinstance(job, GenerationJob)
    for name in [*(n for n in dir(EngineSurface) if not n.startswith("_")), *EngineSurface.__annotations__]:
        declared = getattr(EngineSurface, name, None)
        assert hasattr(Engine, name) or f"self.{name} = " in inspect.getsource(Engine.__init__), name
        if inspect.isfunction(declared):
            expected = [(k, p.default) for k, p in inspect.signature(declared).parameters.items()]
            for method in (getattr(Engine, name), getattr(fake, name).__func__):
                assert [(k, p.default) for k, p in inspect.signature(method).parameters.items()] == expected, \
                    f"{method.__qualname__}{inspect.signature(method)}"


@pytest.fixture
def app(tmp_path: Path) -> tuple[falcon.testing.TestClient, FakeEngine, Path]:
    return make_app(tmp_path)


MESSAGES = {"model": "claude-sonnet-5", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}
CHAT = {"model": "gpt-x", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}


def store(db: Path) -> tuple[int, ...]:
    return tuple(query(db, f"SELECT count(*) FROM {t}")[0][0] for t in ("agents", "conversations", "messages"))


def test_a_turn_is_answered_and_its_history_stored(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    response = client.simulate_post("/v1/messages", json=MESSAGES, headers={"x-session-id": "s1"})
    assert response.status_code == 200 and response.json["content"][0]["text"] == "Hello there."
    assert engine.submitted[0].agent_id == "s1" and engine.submitted[0].conversation_id
    assert query(db, "SELECT role FROM messages WHERE agent_id = 's1' ORDER BY position") == [("user",), ("assistant",)]
    chat = client.simulate_post("/v1/chat/completions", json=CHAT)
    assert chat.status_code == 200 and chat.json["choices"][0]["message"]["content"] == "Hello there."


def test_the_request_line_and_metrics_count_the_drafts_kept(app, caplog) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    with caplog.at_level(logging.INFO, logger="app.api.generation"):
        client.simulate_post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s-plain"})
        assert "drafts" not in caplog.text
        engine.drafts = (68, 41)
        client.simulate_post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s-drafted"})
    assert "tok/s (drafts 41/68 kept), " in caplog.text
    metrics = client.simulate_get("/metrics").text
    assert "semantic_draft_tokens_total 68.0" in metrics and "semantic_draft_accepted_tokens_total 41.0" in metrics


def test_time_to_first_token_counts_from_arrival_and_is_stored_and_reported_in_parts(app, caplog) -> None:  # type: ignore[no-untyped-def]
    """The engine's clock starts at the request's arrival (middleware), before the body is
    read and the prompt rendered; the parts it reports are logged, stored and exported."""
    client, engine, db = app
    engine.parts = (0.25, 1.5, 0.75)
    before = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="app.api.generation"):
        response = client.simulate_post("/v1/messages", json=MESSAGES, headers={"x-session-id": "s-ttft"})
    assert response.status_code == 200
    assert "ttft 2.50 s (queue 0.25, restore 1.50, prefill 0.75)" in caplog.text
    arrived = engine.submitted[-1].arrived_at
    assert arrived is not None and before <= arrived <= engine.submitted_at[-1]
    row = query(db, "SELECT ttft_ms, queue_ms, restore_ms, prefill_ms, total_ms FROM requests "
                    "WHERE agent_id = 's-ttft'")
    assert row == [(pytest.approx(2500), pytest.approx(250), pytest.approx(1500), pytest.approx(750),
                    pytest.approx(2510))]
    metrics = client.simulate_get("/metrics").text
    for name, total in (("semantic_ttft_seconds", 2.5), ("semantic_ttft_queue_seconds", 0.25),
                        ("semantic_ttft_restore_seconds", 1.5), ("semantic_ttft_prefill_seconds", 0.75)):
        assert f"{name}_count 1.0" in metrics and f"{name}_sum {total}" in metrics, name


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_request_refused_from_the_queue_gets_429_or_the_streams_error_event(  # type: ignore[no-untyped-def]
        app, stream) -> None:
    """Past ``max_queue_wait_s`` in the queue (the engine's QueueTimeout, tested on the real
    engine in tests/integration/test_queue_wait.py): a 429 with the engine's retry-after, or,
    once a stream's headers went out (it waited past a heartbeat), an Anthropic error event."""
    client, engine, db = app
    engine.expire = QueueTimeout("the request waited 300 s in the queue without starting", 42)
    engine.queued = stream
    response = client.simulate_post("/v1/messages", json={**MESSAGES, "stream": stream},
                                    headers={"x-session-id": f"s-expired-{stream}"})
    if stream:
        assert response.status_code == 200
        assert "event: error" in response.text and "rate_limit_error" in response.text, response.text
    else:
        assert response.status_code == 429 and response.headers["retry-after"] == "42"
        assert response.json["error"]["type"] == "rate_limit_error"
    assert "waited 300 s in the queue" in response.text
    rows = query(db, "SELECT status FROM requests WHERE agent_id = ?", f"s-expired-{stream}")
    assert rows and rows[0][0] != "running", rows


@pytest.mark.parametrize("path,stream", [("/v1/messages", False), ("/v1/messages", True),
                                         ("/v1/chat/completions", True), ("/api/chat", True)])
def test_a_reply_cancelled_part_way_is_an_error_not_a_finished_reply(  # type: ignore[no-untyped-def]
        app, path, stream, caplog) -> None:
    """Issue 62: a stream the server cancelled (Ctrl-C on the server) ended with
    ``stop_reason: end_turn``, and a client took the half answer as whole. Now a 503, or the
    protocol's error in the stream; the row says cancelled and no history is stored."""
    client, engine, db = app
    engine.stop_reason = "cancelled"
    session = f"s-cancelled-{path.replace('/', '-')}-{stream}"
    body = {**MESSAGES, "stream": stream}
    if path == "/v1/chat/completions":
        body = {"model": "m", "stream": True, "messages": MESSAGES["messages"]}
    elif path == "/api/chat":
        body = {"model": "m", "stream": True, "messages": MESSAGES["messages"], "session_id": session}
    response = client.simulate_post(path, json=body, headers={"x-session-id": session})
    assert "end_turn" not in response.text and '"stop"' not in response.text, response.text
    if stream:
        assert response.status_code == 200 and "was cancelled before its reply ended" in response.text
        assert "message_stop" not in response.text and "[DONE]" not in response.text, response.text
    else:
        assert response.status_code == 503 and response.json["error"]["type"] == "api_error"
    assert query(db, "SELECT status, stop_reason FROM requests WHERE agent_id = ?", session) == \
        [("cancelled", "cancelled")]
    assert query(db, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(0,)]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # a client leaving is no server error


@pytest.mark.parametrize("refusal,status,kind,retry", [
    (Overloaded("16 requests are already waiting"), 429, "rate_limit_error", True),
    # One that can never fit the memory budget: a 400 saying so, no retry-after (a 529 had
    # clients retry it forever, issue 59 item 6).
    (TooLargeForMemory("needs 900 MiB; the budget is 256 MiB"), 400, "invalid_request_error", False),
])
def test_admission_refusals_have_their_status_retry_after_and_write_nothing(  # type: ignore[no-untyped-def]
        app, refusal, status, kind, retry) -> None:
    client, engine, db = app
    engine.refuse = refusal
    before = store(db)
    response = client.simulate_post("/v1/messages", json=MESSAGES, headers={"x-session-id": "s2"})
    assert response.status_code == status and response.json["error"]["type"] == kind
    assert ("retry-after" in response.headers) == retry and (not retry or int(response.headers["retry-after"]) >= 1)
    assert str(refusal) in response.json["error"]["message"]
    assert store(db) == before  # no agent, conversation or message for a refused request
    assert query(db, "SELECT status FROM requests") == [("rejected",)]
    chat = client.simulate_post("/v1/chat/completions", json=CHAT)
    assert chat.status_code == status
    assert chat.json["error"]["type"] in ("rate_limit_exceeded", "server_error", "invalid_request_error")


def test_a_prompt_beyond_the_context_is_the_anthropic_400_and_writes_nothing(app) -> None:  # type: ignore[no-untyped-def]
    client, _, db = app
    long = {**MESSAGES, "messages": [{"role": "user", "content": "word " * 200}]}
    response = client.simulate_post("/v1/messages", json=long)
    assert response.status_code == 400
    assert response.json["error"]["message"].startswith("prompt is too long:")
    assert store(db) == (0, 0, 0)


def test_health_says_loading_until_the_engine_is_ready(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    engine.loading = True
    response = client.simulate_get("/health")
    assert response.status_code == 503 and response.json["status"] == "loading"
    assert response.json["kv_format"] is None
    engine.loading = False
    health = client.simulate_get("/health").json
    assert health["status"] == "ok"
    assert health["kv_format"] == {"name": "k6v4", "chosen_by": "calibration", "bytes_vs_fp16": 0.3438,
                                   "top1_agreement": 0.986, "perplexity_change": 0.0033, "kl_mean": 0.0011}


def test_health_and_semantic_status_show_the_prefills_in_flight(
        app, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    engine.prefills = (PrefillProgress("req_1", "planner", 1024, 4249),)
    health = client.simulate_get("/health").json
    assert health["prefilling"] == [{"request_id": "req_1", "agent_id": "planner", "done_tokens": 1024,
                                     "total_tokens": 4249}]
    monkeypatch.setattr(status, "read_health", lambda url, key="": client.simulate_get("/health").json)
    _, _, db = app
    report = status.format_report(status.collect(Settings(home=db.parent), "http://fake"))
    assert "prefill  req_1 (agent planner): 1024 of 4249 new tokens" in report


def test_health_without_the_key_counts_the_prefills_in_flight_without_naming_them(tmp_path: Path) -> None:
    """Issue 59, item 4: on a server with a key, /health answers without it (a probe), but the
    agents and requests in flight are for the key's holder."""
    db = tmp_path / "semantic.db"
    upgrade(f"sqlite:///{db}")
    sessions = make_session_factory(make_engine(f"sqlite:///{db}"))
    engine = FakeEngine(tmp_path)
    engine.prefills = (PrefillProgress("req_1", "planner", 1024, 4249),)
    settings = Settings(home=tmp_path, allowed_hosts="falconframework.org", api_key="k" * 32)
    client = falcon.testing.TestClient(create_app(Deps(settings, engine, AgentService(sessions), sessions)))
    anonymous = client.simulate_get("/health")
    assert anonymous.status_code == 200
    assert anonymous.json["prefilling"] == [{"done_tokens": 1024, "total_tokens": 4249}]
    assert "planner" not in anonymous.text and "req_1" not in anonymous.text
    keyed = client.simulate_get("/health", headers={"x-api-key": "k" * 32}).json
    assert keyed["prefilling"] == [{"request_id": "req_1", "agent_id": "planner", "done_tokens": 1024,
                                    "total_tokens": 4249}]
    wrong = client.simulate_get("/health", headers={"x-api-key": "x" * 32}).json
    assert "planner" not in json.dumps(wrong)
    assert client.simulate_get("/v1/models").status_code == 401  # other routes still want it


def test_health_the_status_page_and_semantic_status_count_conversations_by_tier_alike(
        app, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """One definition (cache_index.Tier): in memory is hot, whatever the store says; warm: a
    cache on disk for some model; cold: every cache made cold."""
    client, engine, db = app
    connection = sqlite3.connect(db)
    with connection:
        connection.execute("INSERT INTO agents (id, origin, created_at, last_access_at, status, metadata_json) "
                           "VALUES ('a', 'direct', '2026-11-01', '2026-11-01', 'active', '{}')")
        for conversation, tiers in (("c-hot", ("warm",)), ("c-warm", ("warm",)), ("c-two", ("cold", "warm")),
                                    ("c-cold", ("cold", "cold"))):
            connection.execute("INSERT INTO conversations (id, agent_id, created_at, last_access_at) "
                               "VALUES (?, 'a', '2026-11-01', '2026-11-01')", (conversation,))
            for i, tier in enumerate(tiers):
                connection.execute("INSERT INTO caches (agent_id, conversation_id, model_fingerprint, n_tokens, tier, "
                                   "created_at, updated_at, last_access_at) VALUES ('a', ?, ?, 10, ?, '2026-11-01', "
                                   "'2026-11-01', '2026-11-01')", (conversation, f"fp{i}", tier))
    connection.close()
    engine.hot = {"a": {"c-hot": 300, "c-new": 20}}  # c-new: in memory, not on disk yet

    health = client.simulate_get("/health").json["cache"]["conversations"]
    assert health == {"hot": 2, "warm": 2, "cold": 1}
    page = client.simulate_get("/status").text
    assert all(f"{name}<b>{n}</b>" in page for name, n in (("conversations hot", 2), ("warm", 2), ("cold", 1)))
    settings = Settings(home=db.parent)
    monkeypatch.setattr(status, "read_health", lambda url, key="": client.simulate_get("/health").json)
    assert asdict(status.collect(settings, "http://server"))["tiers"] == health
    monkeypatch.setattr(status, "read_health", lambda url, key="": None)  # no server: nothing is hot
    assert asdict(status.collect(settings, "http://server"))["tiers"] == {"hot": 0, "warm": 3, "cold": 1}


def test_routing_and_protocol_error_shapes(app) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = app
    assert client.simulate_head("/").status_code == 200
    assert client.simulate_get("/v1/nope").json["error"]["type"] == "not_found_error"
    assert client.simulate_get("/v1/chat/nope").json["error"]["type"] == "invalid_request_error"
    assert client.simulate_get("/v1/agents/missing").status_code == 404
    bad = client.simulate_post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert bad.status_code == 400 and "messages" in bad.json["error"]["message"]
    created = client.simulate_post("/v1/agents", json={"id": "a1", "system_prompt": "Be brief."})
    assert created.status_code == 201 and created.json["id"] == "a1"
    generated = client.simulate_post("/v1/agents/a1/generate", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert generated.status_code == 200 and generated.json["content"][0]["text"] == "Hello there."
    assert [m["role"] for m in client.simulate_get("/v1/agents/a1/history").json["messages"]] == ["user", "assistant"]


def test_direct_agent_api_passes_the_speculate_extension(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = app
    client.simulate_post("/v1/agents", json={"id": "s1", "prefill": False})
    for speculate in (True, False):
        body = {"messages": [{"role": "user", "content": f"Hi {speculate}"}], "speculate": speculate}
        assert client.simulate_post("/v1/agents/s1/generate", json=body).status_code == 200
        assert engine.submitted[-1].sampling.speculate is speculate


@pytest.fixture
def keyed(tmp_path: Path) -> falcon.testing.TestClient:
    db = tmp_path / "semantic.db"
    upgrade(f"sqlite:///{db}")
    sessions = make_session_factory(make_engine(f"sqlite:///{db}"))
    settings = Settings(home=tmp_path, allowed_hosts="falconframework.org", api_key="the-key")
    return falcon.testing.TestClient(create_app(Deps(settings, FakeEngine(tmp_path), AgentService(sessions), sessions)))


def test_every_route_but_the_probes_wants_the_key(keyed: falcon.testing.TestClient) -> None:
    """Every registered route and method answers 401 without the key, in its protocol's
    error shape; the probes (/, /health, /metrics) answer without it."""
    from falcon import inspect as falcon_inspect

    from app.api.middleware import OPEN_PATHS, protocol_of

    checked = 0
    for route in falcon_inspect.inspect_routes(keyed.app):
        path = route.path.replace("{", "").replace("}", "")  # /v1/agents/{agent_id} -> /v1/agents/agent_id
        for method in (m.method for m in route.methods if not m.internal):
            body = {} if method in ("POST", "PUT", "PATCH") else None
            for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
                result = keyed.simulate_request(method, path, json=body, headers=headers)
                if route.path in OPEN_PATHS:
                    assert result.status_code != 401, (method, path)
                    continue
                assert result.status_code == 401, (method, path, headers, result.text)
                shape = result.json
                if protocol_of(path) in ("anthropic", "direct"):
                    assert shape["type"] == "error" and shape["error"]["type"] == "authentication_error", shape
                elif protocol_of(path) == "ollama":
                    assert set(shape) == {"error"} and "API key" in shape["error"], shape
                else:
                    assert "API key" in shape["error"]["message"], shape
                checked += 1
    assert checked >= 3 * 14  # every route of every API: Anthropic, OpenAI, Responses, agents, models, status
    assert keyed.simulate_get("/v1/models", headers={"x-api-key": "the-key"}).status_code == 200
    assert keyed.simulate_get("/v1/models", headers={"authorization": "Bearer the-key"}).status_code == 200


def test_a_cors_preflight_with_a_key_set(keyed: falcon.testing.TestClient) -> None:
    """A browser's preflight carries no key: an allowed origin gets its CORS answer, a
    foreign one 403; the request that follows still needs the key."""
    preflight = {"origin": "http://localhost:3000", "access-control-request-method": "POST",
                 "access-control-request-headers": "x-api-key, content-type"}
    allowed = keyed.simulate_options("/v1/messages", headers=preflight)
    assert allowed.status_code == 204
    assert allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-api-key" in allowed.headers["access-control-allow-headers"]
    assert keyed.simulate_options("/v1/messages", headers={**preflight, "origin": "https://evil.example"}).status_code == 403
    assert keyed.simulate_post("/v1/messages", json=MESSAGES, headers={"origin": "http://localhost:3000"}).status_code == 401


def test_a_url_or_header_cannot_forge_a_line_of_the_request_log(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """``%0A`` in a URL (decoded to a newline) and control characters in the User-Agent are
    logged escaped, before authentication too: the request writes one line, never a second
    one of the attacker's (before: a forged "... INFO ... 200" line)."""
    db = tmp_path / "semantic.db"
    upgrade(f"sqlite:///{db}")
    sessions = make_session_factory(make_engine(f"sqlite:///{db}"))
    settings = Settings(home=tmp_path, allowed_hosts="falconframework.org", api_key="k")
    client = falcon.testing.TestClient(create_app(Deps(settings, FakeEngine(tmp_path), AgentService(sessions),
                                                       sessions)))
    forged = "\n2026-11-27 00:00:00,000 INFO app.api.middleware: GET /admin 200 request req_x"
    with caplog.at_level(logging.INFO, logger="app.api.middleware"):
        refused = client.simulate_get("/v1/agents/x%0A2026-11-27%2000:00:00,000%20INFO%20forged%0D%E2%80%A8",
                                      headers={"user-agent": "curl" + forged.replace("\n", "\x0b")})
        missing = client.simulate_get("/nowhere%0Aforged", headers={"x-api-key": "k"})
    assert (refused.status_code, missing.status_code) == (401, 404)
    lines = [record.getMessage() for record in caplog.records if record.name == "app.api.middleware"]
    assert len(lines) == 2
    for line in lines:
        assert line.isprintable(), line  # no newline, carriage return or line separator
    assert "x\\n2026-11-27 00:00:00,000 INFO forged\\r\\u2028" in lines[0] and "/nowhere\\nforged" in lines[1]


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "claude-x", "max_tokens": 8, "system": "Answer in French.",
                      "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"model": "gpt-x", "max_output_tokens": 8, "instructions": "Answer in French.",
                       "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}),
    ("/v1/chat/completions", {"model": "gpt-x", "max_tokens": 8, "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]}),
    ("/api/chat", {"model": "m", "stream": False, "messages": [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]}),
], ids=["anthropic", "responses", "openai", "ollama"])
def test_a_direct_turn_refuses_a_conversation_it_cannot_rebuild(app, path: str, body: dict) -> None:  # type: ignore[no-untyped-def]
    """Another API's system prompt, tools and tool turns are not kept in a shape a direct turn
    can replay (before: dropped silently, or an OpenAI tool result turned into user text, and
    the model answered another prompt): a 400 that says so, and nothing stored."""
    client, _, db = app
    made = client.simulate_post(path, headers={"x-session-id": "foreign"}, json=body)
    assert made.status_code == 200, made.text
    stored = query(db, "SELECT count(*) FROM messages")
    refused = client.simulate_post("/v1/agents/foreign/generate", json={"messages": [{"role": "user", "content": "Again"}]})
    assert refused.status_code == 400, refused.text
    assert refused.json["type"] == "error"  # the direct API's (Anthropic's) error shape
    assert "API" in refused.json["error"]["message"] and "continue it through" in refused.json["error"]["message"]
    assert query(db, "SELECT count(*) FROM messages") == stored


def test_the_key_form_opens_the_pages_to_a_browser_and_to_nothing_else(keyed: falcon.testing.TestClient) -> None:
    """With api_key set, / shows a key form; the right key sets an HttpOnly, SameSite=Strict
    cookie (not the key) that opens /status, /docs and /openapi.json to a same-origin or
    typed-in GET, never the API, a cross-site request or a wrong key's cookie."""
    from app.api.page_key import COOKIE

    browser = {"host": "localhost:8000", "origin": "http://localhost:8000"}
    assert 'action="/session"' in keyed.simulate_get("/", headers={"accept": "text/html"}).text
    for path in ("/status", "/docs", "/openapi.json"):
        assert keyed.simulate_get(path).status_code == 401
    wrong = keyed.simulate_post("/session", body="key=nope", headers={
        **browser, "content-type": "application/x-www-form-urlencoded"})
    assert wrong.status_code == 401 and COOKIE not in wrong.cookies
    signed = keyed.simulate_post("/session", body="key=the-key", headers={
        **browser, "content-type": "application/x-www-form-urlencoded"})
    assert signed.status_code == 303 and signed.headers["location"] == "/"
    cookie = signed.cookies[COOKIE]
    assert cookie.http_only and cookie.same_site == "Strict" and cookie.value != "the-key"
    sent = {"cookie": f"{COOKIE}={cookie.value}", "host": "localhost:8000"}
    for path in ("/status", "/docs", "/openapi.json"):
        for fetch_site in ({}, {"sec-fetch-site": "same-origin"}, {"sec-fetch-site": "none"}):
            assert keyed.simulate_get(path, headers={**sent, **fetch_site}).status_code == 200, (path, fetch_site)
        assert keyed.simulate_get(path, headers={**sent, "sec-fetch-site": "cross-site"}).status_code == 401
    assert keyed.simulate_get("/v1/models", headers=sent).status_code == 401  # the API wants its header
    assert keyed.simulate_post("/v1/messages", json=MESSAGES, headers=sent).status_code == 401
    assert keyed.simulate_get("/status", headers={"cookie": f"{COOKIE}=forged"}).status_code == 401
    foreign = keyed.simulate_post("/session", body="key=the-key", headers={
        "origin": "https://evil.example", "content-type": "application/x-www-form-urlencoded"})
    assert foreign.status_code == 403  # no other site's page posts the form
    assert keyed.simulate_post("/session", body="key=the-key", headers={
        "content-type": "application/x-www-form-urlencoded"}).status_code == 415  # a form comes from a browser


def test_a_direct_turn_may_start_a_new_conversation_and_caches_name_their_model(app) -> None:  # type: ignore[no-untyped-def]
    """``new_conversation`` starts a conversation of the agent with only the new messages (the
    people page's "new conversation"), also when the latest one came through another API; a
    cache names its model where the server knows the fingerprint."""
    client, engine, db = app
    made = client.simulate_post("/v1/messages", headers={"x-session-id": "mixed"},
                                json={"model": "m", "max_tokens": 8, "system": "Be brief.",
                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert made.status_code == 200, made.text
    turn = {"messages": [{"role": "user", "content": "Hello again"}], "max_tokens": 8}
    assert client.simulate_post("/v1/agents/mixed/generate", json=turn).status_code == 400
    bad = client.simulate_post("/v1/agents/mixed/generate", json={**turn, "new_conversation": "yes"})
    assert bad.status_code == 400 and "new_conversation" in bad.json["error"]["message"]
    fresh = client.simulate_post("/v1/agents/mixed/generate", json={**turn, "new_conversation": True})
    assert fresh.status_code == 200, fresh.text
    assert "Be brief." not in engine.submitted[-1].prompt.text and "Hi" not in engine.submitted[-1].prompt.text.split()
    assert client.simulate_post("/v1/agents/mixed/generate", json=turn).status_code == 200  # continues the new one
    assert "Hello again" in engine.submitted[-1].prompt.text
    agent = client.simulate_get("/v1/agents/mixed").json
    assert len(agent["conversations"]) == 2 and agent["conversations"][0]["n_messages"] == 4
    engine.hot = {"mixed": {agent["conversations"][0]["id"]: 12}}
    caches = client.simulate_get("/v1/agents/mixed").json["conversations"][0]["caches"]
    assert caches[0] == {"model_fingerprint": "fp-fake", "model": "fake", "cached_tokens": 12, "tier": "hot"}


def test_the_cache_header_comes_from_the_lease_and_a_queued_stream_says_pending(
        app: tuple[falcon.testing.TestClient, FakeEngine, Path]) -> None:
    client, engine, db = app
    engine.reuse = ReuseReport("extend", 40, source="disk", n_tokens=12, kv_format="q8")
    expected = "source=disk; reason=extend; tokens=12; format=q8"
    for path, body in (("/v1/messages", MESSAGES), ("/v1/chat/completions", CHAT)):
        for stream in (False, True):
            response = client.simulate_post(path, json={**body, "stream": stream})
            assert response.status_code == 200 and response.headers["x-semantic-cache"] == expected, (path, stream)
    assert query(db, "SELECT DISTINCT cache_source FROM requests") == [("disk",)]
    # A stream still queued after a heartbeat sends its head without waiting for the lease.
    engine.queued = True
    streamed = client.simulate_post("/v1/messages", json={**MESSAGES, "stream": True})
    assert streamed.headers["x-semantic-cache"] == "source=pending"
    assert "message_stop" in streamed.text
