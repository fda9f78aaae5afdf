"""GET /openapi.json and /docs: every route the router serves is documented, the document is
valid OpenAPI 3.1, its request body schemas accept the requests the other tests send (and a
recorded Codex request) and refuse what the server refuses, its error schemas describe the
errors the server sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import falcon.testing
import jsonschema
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate as validate_openapi
from pydantic import ValidationError

from app.agents.service import AgentService
from app.api.openapi import ERROR_SCHEMAS, OPERATIONS, UNDOCUMENTED, routes
from app.api.middleware import OPEN_PATHS, protocol_of
from app.api.routes import Deps
from app.main import create_app
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade

from test_protocol_fuzz import VALID, mutated
from support.fake_engine import FakeEngine

CODEX = json.loads((Path(__file__).parents[1] / "unit" / "data" / "codex_requests.json").read_text())

# Per documented request body: the bodies other tests send (test_protocol_fuzz, a recorded
# Codex request), and one the server refuses with a 400.
EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "/v1/messages": [VALID["/v1/messages"], {"model": "claude-sonnet-5", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "Say hi."}]}],
    "/v1/messages/count_tokens": [VALID["/v1/messages/count_tokens"]],
    "/v1/chat/completions": [VALID["/v1/chat/completions"], {"model": "gpt-x", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]}],
    "/v1/completions": [VALID["/v1/completions"], {"model": "m", "prompt": ["Once upon"], "stream": True}],
    "/v1/responses": [VALID["/v1/responses"], {"model": "m", "input": "Hi", "max_output_tokens": 4},
                      {**CODEX["body"], "max_output_tokens": 4}],
    "/v1/agents": [VALID["/v1/agents"], {"id": "a1", "system_prompt": "Be brief."}],
    "/v1/agents/{agent_id}/generate": [VALID["/v1/agents/fuzz-direct/generate"],
                                       {"messages": [{"role": "user", "content": "Hi"}]}],
    "/v1/agents/{agent_id}/fork": [{"id": "forked", "at_turn": 0, "metadata": {"why": "try"}}, {}],
    "/api/chat": [VALID["/api/chat"], {"model": "fake", "messages": [{"role": "user", "content": "Hi"}],
                                       "stream": False}],
    "/api/generate": [VALID["/api/generate"], {"model": "fake", "prompt": "Hi", "stream": False}],
    "/api/show": [{"model": "fake"}, {"name": "fake", "verbose": True}],
}
INVALID: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    "/v1/messages/count_tokens": {"model": "m", "messages": []},
    "/v1/chat/completions": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"},
    "/v1/completions": {"model": "m", "prompt": 5},
    "/v1/responses": {"model": "m", "input": "Hi", "temperature": 3},
    "/v1/agents": {"id": "a b", "system_prompt": "Be brief."},
    "/v1/agents/{agent_id}/generate": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
    "/v1/agents/{agent_id}/fork": {"at_turn": -1},
    "/api/chat": {"model": "fake", "messages": [{"role": "robot", "content": "Hi"}]},
    "/api/generate": {"model": "fake", "prompt": 5},
    "/api/show": {"model": ""},
}


def _client(home: Path, **options: Any) -> falcon.testing.TestClient:
    db = home / "semantic.db"
    upgrade(f"sqlite:///{db}")
    sessions = make_session_factory(make_engine(f"sqlite:///{db}"))
    settings = Settings(home=home, allowed_hosts="falconframework.org", **options)
    return falcon.testing.TestClient(create_app(Deps(settings, FakeEngine(home), AgentService(sessions), sessions)))


@pytest.fixture
def client(tmp_path: Path) -> falcon.testing.TestClient:
    return _client(tmp_path)


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    response = _client(tmp_path_factory.mktemp("openapi")).simulate_get("/openapi.json")
    assert response.status_code == 200
    return response.json


def schema_of(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """The operation's request body schema, with the document's components beside it for its $refs."""
    ref = document["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
    return {**ref, "components": document["components"]}


def test_every_route_and_method_is_documented(client: falcon.testing.TestClient, document: dict[str, Any]) -> None:
    served = routes(client.app)
    assert ("POST", "/v1/messages") in served and ("GET", "/v1/agents/{agent_id}/history") in served
    documented = [(method.upper(), path) for path, methods in document["paths"].items() for method in methods]
    assert sorted(documented) == sorted(served)
    undocumented = [(m.upper(), p) for p, methods in document["paths"].items() for m, op in methods.items()
                    if op.get(UNDOCUMENTED)]
    assert undocumented == [], "add these routes to app/api/openapi.py OPERATIONS"
    assert set(OPERATIONS) == set(served), "OPERATIONS documents a route the app does not serve"


def test_a_route_added_without_documentation_is_marked(tmp_path: Path) -> None:
    from app.api.openapi import build_document

    class Extra:
        def on_put(self, req: falcon.Request, resp: falcon.Response, item: int) -> None:
            pass

    app = _client(tmp_path).app
    app.add_route("/v1/extra/{item:int}", Extra())
    document = build_document(app, api_key_required=False)
    extra = document["paths"]["/v1/extra/{item}"]["put"]
    assert extra[UNDOCUMENTED] is True and extra["summary"] == "PUT /v1/extra/{item:int} (undocumented)"
    validate_openapi(document)  # still a valid document


def test_the_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    validate_openapi(document)
    from importlib.metadata import version

    assert document["info"]["version"] == version("semantic")


def test_every_request_body_validates_the_tests_requests_and_refuses_a_bad_one(
        client: falcon.testing.TestClient, document: dict[str, Any]) -> None:
    """The schema and the server agree: each example is accepted by both, the invalid body is
    refused by both (a 400 in the protocol's error shape, which its error schema describes)."""
    bodies = {path for path, methods in document["paths"].items() for op in methods.values() if "requestBody" in op}
    assert bodies == set(EXAMPLES) == set(INVALID)
    assert client.simulate_post("/v1/agents", json={"id": "target", "prefill": False}).status_code == 201
    for path in EXAMPLES:
        schema = schema_of(document, "POST", path)
        url = path.replace("{agent_id}", "target")
        for example in EXAMPLES[path]:
            jsonschema.validate(example, schema)
            answered = client.simulate_post(url, json=example)
            # Codex's prompt is parsed, then longer than the fake engine's 64-word context.
            assert answered.status_code in (200, 201) or "prompt is too long" in answered.text, (path, answered.text)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(INVALID[path], schema)
        refused = client.simulate_post(url, json=INVALID[path])
        assert refused.status_code == 400, (path, refused.text)
        error_schema = {"$ref": f"#/components/schemas/{ERROR_SCHEMAS[protocol_of(path)]}",
                        "components": document["components"]}
        jsonschema.validate(refused.json, error_schema)


def test_error_schemas_describe_the_errors_the_server_sends(client: falcon.testing.TestClient,
                                                             document: dict[str, Any]) -> None:
    answers = {"/v1/agents/missing": client.simulate_get("/v1/agents/missing"),
               "/v1/chat/nowhere": client.simulate_get("/v1/chat/nowhere"),
               "/v1/responses": client.simulate_post("/v1/responses", body="not json",
                                                     headers={"content-type": "application/json"}),
               "/v1/messages": client.simulate_post("/v1/messages", body="x", headers={"content-type": "text/plain"}),
               "/v1/responses/resp_missing": client.simulate_get("/v1/responses/resp_missing")}
    assert [a.status_code for a in answers.values()] == [404, 404, 400, 415, 404]
    for path, answer in answers.items():
        jsonschema.validate(answer.json, {"$ref": f"#/components/schemas/{ERROR_SCHEMAS[protocol_of(path)]}",
                                          "components": document["components"]})
    with pytest.raises(jsonschema.ValidationError):  # not empty schemas: the Anthropic one refuses OpenAI's shape
        jsonschema.validate(answers["/v1/chat/nowhere"].json, {"$ref": "#/components/schemas/AnthropicError",
                                                              "components": document["components"]})


# The bodies that are a model's schema as it is, and that test_protocol_fuzz mutates.
MODELS = {path: op.body.model for (_, path), op in OPERATIONS.items()
          if op.body and op.body.name is None and path in VALID}


@pytest.mark.parametrize("path", sorted(MODELS))
@settings(max_examples=40, deadline=None,  # 40 accepted bodies a route (most mutations are refused: discarded)
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(data=st.data())
def test_the_schema_accepts_every_body_the_model_accepts(document: dict[str, Any], path: str,
                                                         data: st.DataObject) -> None:
    """Mutated valid bodies (test_protocol_fuzz): whatever the server's model accepts, the
    schema accepts too, so a client that checks its requests against the document is never
    wrong to send what the server takes. A body the model refuses is discarded (``assume``),
    so each route checks 40 accepted bodies (hypothesis fails the test as Unsatisfiable if it
    finds none; ``pytest --hypothesis-show-statistics`` says how many it checked)."""
    body = json.loads(json.dumps(data.draw(mutated(path))))
    try:
        MODELS[path].model_validate(body)
    except ValidationError:
        assume(False)
    event("accepted by the model: checked against the schema")
    jsonschema.validate(body, schema_of(document, "POST", path))


def test_docs_page_names_every_operation(client: falcon.testing.TestClient, document: dict[str, Any]) -> None:
    page = client.simulate_get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text and "http://" not in page.text and "https://" not in page.text
    for path, methods in document["paths"].items():
        for method in methods:
            assert f"<td><b>{method.upper()}</b></td><td><code>{path}</code></td>" in page.text, (method, path)
    for name in document["components"]["schemas"]:
        assert f'id="schema-{name}"' in page.text
    root = client.simulate_get("/", headers={"accept": "text/html"})
    assert 'href="/docs"' in root.text and 'href="/openapi.json"' in root.text


def test_the_docs_follow_the_api_key_and_local_only_rules(tmp_path: Path) -> None:
    keyed = _client(tmp_path, api_key="the-key")
    for path in ("/openapi.json", "/docs"):
        assert keyed.simulate_get(path).status_code == 401
        assert keyed.simulate_get(path, headers={"host": "evil.example"}).status_code == 403
        assert keyed.simulate_get(path, headers={"x-api-key": "the-key"}).status_code == 200
    document = keyed.simulate_get("/openapi.json", headers={"authorization": "Bearer the-key"}).json
    validate_openapi(document)
    assert document["security"] == [{"apiKey": []}, {"bearer": []}]
    assert document["components"]["securitySchemes"]["apiKey"] == {
        "type": "apiKey", "in": "header", "name": "x-api-key",
        "description": "the server's api_key (SEMANTIC_API_KEY), when it has one"}
    for path, methods in document["paths"].items():
        for op in methods.values():
            assert ("security" in op and op["security"] == []) == (path in OPEN_PATHS), path
    assert "This server has an api_key" in keyed.simulate_get("/docs", headers={"x-api-key": "the-key"}).text
