"""Every request shape the official SDK's Responses types allow either works or gets a 400 in
OpenAI's shape naming the field (issue 23). The shapes are generated from the SDK's own
TypedDicts (openai, pinned): each input item type, each tool type, each tool choice, each
literal value of each top-level field, each with its required keys filled in, against the
app with a fake engine and the real store."""

from __future__ import annotations

import json
import typing
from typing import Any, Iterator

import falcon.testing
import pytest
import typing_extensions
from openai.types.responses import response_create_params, response_input_param, tool_param
from typing_extensions import is_typeddict

from app.agents.service import AgentService
from app.api.routes import Deps
from app.main import create_app
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade

from support.fake_engine import FakeEngine

BASE = {"model": "m", "input": "Hi", "max_output_tokens": 4}


def _strip(hint: Any) -> Any:
    while typing.get_origin(hint) in (typing.Required, typing.NotRequired, typing.Annotated,
                                      typing_extensions.Required, typing_extensions.NotRequired):
        hint = typing.get_args(hint)[0]
    return hint


def options(hint: Any) -> list[Any]:
    """One value per alternative of a type (each literal value, each union member), required keys filled."""
    hint = _strip(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return list(args)
    if origin is typing.Union:
        return [value for arg in args if arg is not type(None) for value in options(arg)]
    if is_typeddict(hint):
        hints = typing.get_type_hints(hint, include_extras=True)  # the SDK's annotations are strings:
        required = {k: v for k, v in hints.items()  # Required[...] is seen only here
                    if typing.get_origin(v) in (typing.Required, typing_extensions.Required)}
        base = {key: options(value)[0] for key, value in required.items()}
        return [base]
    if origin in (list, typing.List) or (origin and getattr(origin, "__name__", "") in ("Iterable", "Sequence")):
        return [[value] for value in options(args[0])[:1]]
    if origin in (dict, typing.Dict):
        return [{}]
    return [{str: "x", int: 1, float: 0.5, bool: True}.get(hint, {})]


def members(union: Any) -> list[Any]:
    return [member for member in typing.get_args(union)]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[falcon.testing.TestClient]:
    home = tmp_path_factory.mktemp("shapes")
    upgrade(f"sqlite:///{home / 'semantic.db'}")
    sessions = make_session_factory(make_engine(f"sqlite:///{home / 'semantic.db'}"))
    yield falcon.testing.TestClient(create_app(Deps(Settings(home=home, allowed_hosts="falconframework.org"),
                                                    FakeEngine(home), AgentService(sessions), sessions)))


def answered(client: falcon.testing.TestClient, body: dict[str, Any]) -> str:
    """``ok`` for a 200 with a response object, else the field the 400 names."""
    response = client.simulate_post("/v1/responses", body=json.dumps(body),
                                    headers={"content-type": "application/json"})
    if response.status_code == 200:
        assert response.json["object"] == "response" and response.json["status"] == "completed", response.text
        return "ok"
    error = response.json["error"]
    assert response.status_code in (400, 404), response.text
    assert set(error) == {"message", "type", "param", "code"} and error["param"], response.text
    assert error["message"].startswith(f"{error['param']}:") or response.status_code == 404, response.text
    return str(error["param"])


ITEMS = [item for member in members(response_input_param.ResponseInputItemParam) for item in options(member)]
TOOLS = [tool for member in members(tool_param.ToolParam) for tool in options(member)]
CHOICES = [choice for member in members(response_create_params.ToolChoice) for choice in options(member)]
FIELDS = [(name, value) for name, hint in typing.get_type_hints(response_create_params.ResponseCreateParamsBase,
                                                                include_extras=True).items()
          if name not in ("model", "input", "previous_response_id") for value in options(hint)]


@pytest.mark.parametrize("item", ITEMS, ids=lambda item: str(item.get("type", item.get("role"))))
def test_every_input_item_type(client: falcon.testing.TestClient, item: dict[str, Any]) -> None:
    outcome = answered(client, {**BASE, "input": [item, {"role": "user", "content": "Hi"}]})
    kind = item.get("type") or ("message" if "role" in item else "item_reference")
    supported = ("message", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning")
    if kind == "function_call":  # the generated arguments, "x", are not JSON
        assert outcome == "input.0.arguments"
        item = {**item, "arguments": "{}"}
        outcome = answered(client, {**BASE, "input": [item, {"role": "user", "content": "Hi"}]})
        kind = "message"
    assert outcome == ("ok" if kind in supported else "input.0.type"), item


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: str(tool["type"]))
def test_every_tool_type(client: falcon.testing.TestClient, tool: dict[str, Any]) -> None:
    assert answered(client, {**BASE, "tools": [tool]}) == "ok"  # hosted tools are left out, not refused


@pytest.mark.parametrize("choice", CHOICES, ids=lambda choice: json.dumps(choice))
def test_every_tool_choice(client: falcon.testing.TestClient, choice: Any) -> None:
    tools = [{"type": "function", "name": "x"}, {"type": "custom", "name": "x_custom"}]
    outcome = answered(client, {**BASE, "tools": tools, "tool_choice": choice})
    assert outcome in ("ok", "tool_choice", "tool_choice.name", "tool_choice.type"), (choice, outcome)
    if choice in ("none", "auto", "required") or (isinstance(choice, dict) and choice.get("type") == "function"):
        assert outcome == "ok"


@pytest.mark.parametrize("name, value", FIELDS, ids=lambda v: json.dumps(v)[:40])
def test_every_top_level_field(client: falcon.testing.TestClient, name: str, value: Any) -> None:
    outcome = answered(client, {**BASE, name: value})
    assert outcome in ("ok", name) or outcome.startswith(f"{name}."), (name, value, outcome)
