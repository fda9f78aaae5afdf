"""Protocol fuzzing of the four APIs (issue 12): valid requests with one part replaced by
random JSON or removed, random JSON documents and random bytes. Every answer is a 2xx
(the mutation happened to be valid) or a 4xx in the protocol's error shape, never a
5xx, and a refused request leaves no agent, conversation or message behind."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator
from urllib.parse import quote

import falcon.testing
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from app.agents.service import AgentService
from app.api.routes import Deps
from app.errors import Overloaded, TooLargeForMemory
from app.main import create_app
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade

from conftest import TEST_STORES
from support.fake_engine import FakeEngine

TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
VALID = {
    "/v1/messages": {"model": "claude-sonnet-5", "max_tokens": 8, "stream": False, "temperature": 0.5,
                     "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                     "tools": [TOOL], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"},
                     "stop_sequences": ["\n\n"],
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                  {"role": "assistant", "content": "Hello."},
                                  {"role": "user", "content": "Weather in Paris?"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/chat/completions": {"model": "gpt-x", "max_tokens": 8, "temperature": 0, "top_p": 0.9, "stop": ["x"],
                             "session_id": "fuzz-openai", "tools": [{"type": "function", "function": {
                                 "name": "f", "parameters": {"type": "object"}}}],
                             "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": "gpt-x", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                        "top_p": 0.9, "stop": ["\n\n"], "session_id": "fuzz-completion"},
    "/v1/responses": {"model": "gpt-x", "max_output_tokens": 8, "temperature": 0, "store": True,
                      "instructions": "Be brief.", "reasoning": {"summary": "auto"}, "tool_choice": "auto",
                      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                                {"type": "custom", "name": "apply_patch"},
                                {"type": "namespace", "name": "ns", "description": "d",
                                 "tools": [{"type": "function", "name": "g"}]},
                                {"type": "web_search"}],
                      "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Hi"}]},
                                {"type": "message", "role": "user", "content": "Hi"},
                                {"type": "reasoning", "id": "rs_1", "summary": []},
                                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "x"},
                                {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
                                {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]},
    "/v1/agents": {"id": "fuzz-agent", "system_prompt": "Be brief.", "metadata": {"k": "v"}, "ttl_seconds": 60,
                   "prefill": False},
    "/v1/agents/fuzz-direct/generate": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    "/v1/agents/fuzz-direct/fork": {"id": "fuzz-fork", "at_turn": 0, "metadata": {"k": "v"}},
    "/api/chat": {"model": "fake", "stream": False, "session_id": "fuzz-ollama", "keep_alive": "5m",
                  "options": {"temperature": 0, "top_k": 40, "num_predict": 8, "stop": ["x"], "num_ctx": 4096},
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                  "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "", "tool_calls": [
                                   {"function": {"name": "f", "arguments": {"a": 1}}}]},
                               {"role": "tool", "content": "ok", "tool_name": "f"}]},
    "/api/generate": {"model": "fake", "stream": False, "prompt": "Hi", "system": "Be brief.",
                      "options": {"temperature": 0.5, "top_p": 0.9, "num_predict": 8}},
}
ROUTES = list(VALID)

any_text = st.text(st.characters(blacklist_categories=()), max_size=12)  # lone surrogates included
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | any_text)
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(any_text, children, max_size=3), max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn, route: str) -> Any:
    """The route's valid body with one node (chosen by walking down) replaced or removed."""
    body = json.loads(json.dumps(VALID[route]))
    parent: Any = None
    key: Any = None
    node: Any = body
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return draw(json_values)
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(json_values)
    return body


@pytest.fixture(scope="module", params=TEST_STORES)
def fuzz_store(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[falcon.testing.TestClient, str, FakeEngine]]:
    """The app on each store: PostgreSQL refuses what SQLite keeps (NUL in text, values
    longer than a column's declared length)."""
    home = tmp_path_factory.mktemp("fuzz")
    url = (f"sqlite:///{home / 'semantic.db'}" if request.param == "sqlite"
           else request.getfixturevalue("postgres").create_database(f"fuzz_{uuid.uuid4().hex[:10]}"))
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    fake = FakeEngine(home)
    app = create_app(Deps(Settings(home=home, allowed_hosts="falconframework.org"), fake,
                          AgentService(sessions), sessions))
    client = falcon.testing.TestClient(app)
    assert client.simulate_post("/v1/agents", json={"id": "fuzz-direct", "prefill": False}).status_code == 201
    yield client, url, fake
    engine.dispose()


@pytest.fixture
def fuzz_app(fuzz_store: tuple[falcon.testing.TestClient, str, FakeEngine]) -> tuple[falcon.testing.TestClient, str]:
    """The client and the store's URL."""
    return fuzz_store[0], fuzz_store[1]


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def stored(url: str) -> dict[str, set[tuple[Any, ...]]]:
    """Every row of the tables a turn writes (an agent's TTLs and access times included)."""
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return {t: {tuple(map(_hashable, row)) for row in connection.execute(text(f"SELECT * FROM {t}"))}
                    for t in ("agents", "conversations", "messages")}
    finally:
        engine.dispose()


def check(client: falcon.testing.TestClient, db: str, route: str, status: int | None = None, **request: Any) -> None:
    """Refused: no row changed. Accepted: the history of every agent it wrote reads back.
    ``status``: the answer expected (default: any but a 5xx)."""
    before = stored(db)
    response = client.simulate_post(route, **request)
    if status is None:
        assert response.status_code < 500, (route, request, response.text)
    else:
        assert response.status_code == status, (route, request, response.text)
    after = stored(db)
    if response.status_code >= 400:
        error = response.json
        if route in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):  # OpenAI's shape
            assert set(error["error"]) >= {"message", "type", "param", "code"}, response.text
        elif route.startswith("/api/"):  # Ollama's
            assert set(error) == {"error"} and isinstance(error["error"], str), response.text
        else:  # Anthropic's, which the direct API shares
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, response.text
        assert after == before, (route, request)
        return
    for agent_id in {row[0] for row in after["agents"] - before["agents"]}:
        history = client.simulate_get(f"/v1/agents/{quote(agent_id, safe='')}/history")
        assert history.status_code == 200 and isinstance(history.json["messages"], list), (route, history.text)
        json.dumps(history.json, ensure_ascii=False).encode("utf-8")  # text a client can decode: no lone surrogate


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("route", ROUTES)
@FUZZ
@given(data=st.data())
def test_mutated_requests_are_answered_or_refused_cleanly(fuzz_app, route: str, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    client, db = fuzz_app
    body = json.dumps(data.draw(mutated(route)))  # ASCII: a lone surrogate travels as its \u escape
    check(client, db, route, body=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("route", ROUTES)
@FUZZ
@given(body=st.binary(max_size=64) | st.text(max_size=64).map(str.encode)
       | st.integers(500, 5000).map(lambda depth: ("[" * depth + "]" * depth).encode()))
def test_random_bytes_are_a_400(fuzz_app, route: str, body: bytes) -> None:  # type: ignore[no-untyped-def]
    client, db = fuzz_app
    check(client, db, route, body=body, headers={"content-type": "application/json"})


def _string_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, str):
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _string_paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _string_paths(value, (*path, index))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("suffix", ["\ud800", "\x00", "x" * 300], ids=["lone-surrogate", "nul", "long"])
def test_an_odd_character_or_length_in_any_string_is_refused_or_reads_back(fuzz_app, route: str,
                                                                         suffix: str) -> None:  # type: ignore[no-untyped-def]
    """Every string of the valid body in turn given an unpaired surrogate, a NUL (as JSON
    escapes) or 300 more characters: whatever the answer, ``check`` holds (a refusal
    writes nothing; what was accepted reads back from /history)."""
    client, db = fuzz_app
    for path in _string_paths(VALID[route]):
        body = json.loads(json.dumps(VALID[route]))
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = node[path[-1]] + suffix
        check(client, db, route, body=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("route,body", [
    ("/v1/agents", {**VALID["/v1/agents"], "id": "refused-agent", "prefill": True}),
    ("/v1/agents/fuzz-direct/fork", {**VALID["/v1/agents/fuzz-direct/fork"], "id": "refused-fork"}),
], ids=["create", "fork"])
@pytest.mark.parametrize("refusal,status", [(Overloaded("16 requests are already waiting"), 429),
                                            (TooLargeForMemory("needs 900 MiB"), 400)], ids=["429", "400"])
def test_a_refused_agent_creation_or_fork_changes_no_row_and_its_retry_succeeds(
        fuzz_store, route: str, body: dict[str, Any], refusal: Exception, status: int) -> None:  # type: ignore[no-untyped-def]
    """The engine refuses the agent's first step (the system prompt's prefill, the fork's cache
    copy) after its rows were written: ``check`` holds (no row changed), and the client's
    retry creates the agent instead of finding it taken (400 "already exists")."""
    client, db, engine = fuzz_store
    engine.refuse = refusal
    try:
        check(client, db, route, status, body=json.dumps(body), headers={"content-type": "application/json"})
    finally:
        engine.refuse = None
    retried = client.simulate_post(route, json=body)
    assert retried.status_code == 201, retried.text
    assert client.simulate_delete(f"/v1/agents/{body['id']}").status_code == 204
