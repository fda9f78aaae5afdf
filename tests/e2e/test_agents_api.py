"""The direct agent API on a real server: 5 turns sending only new messages."""

from __future__ import annotations

import json
import os

import httpx

from conftest import ServerProcess
from support.dbcheck import query, wait_persisted


def test_five_turns_history_and_delete(server: ServerProcess) -> None:
    api = httpx.Client(base_url=server.url, timeout=120)
    created = api.post("/v1/agents", json={"id": "planner", "system_prompt": "You are a terse planner."})
    assert created.status_code == 201, created.text
    prefilled = created.json()["caches"][0]["cached_tokens"]  # the system prompt, computed at creation
    assert created.json()["tier"] == "hot" and prefilled > 5
    assert api.post("/v1/agents", json={"id": "planner"}).status_code == 400  # taken

    sent, replies = [], []
    for i, question in enumerate(["Plan a picnic.", "What food?", "What drinks?", "Who to invite?", "When?"]):
        response = api.post("/v1/agents/planner/generate", json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        sent.append(question)
        replies.append(body["content"][0]["text"])
        # The first turn reuses the prefilled system prompt, each later one everything before it.
        assert body["usage"]["cache_read_input_tokens"] >= (prefilled if i == 0 else prefilled + 10)

    history = api.get("/v1/agents/planner/history").json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"] * 5
    assert [m["content"] for m in history[0::2]] == sent
    assert [m["content"][0]["text"] for m in history[1::2]] == replies
    outcomes = query(server.db_path, "SELECT protocol, match_outcome FROM requests WHERE agent_id = 'planner' "
                     "ORDER BY created_at")
    assert [o for _, o in outcomes] == ["extend"] * 5 and {p for p, _ in outcomes} == {"direct"}

    status = api.get("/v1/agents/planner").json()
    assert status["tier"] == "hot" and status["n_messages"] == 10
    wait_persisted(server.db_path, "planner", 50)
    assert api.get("/v1/agents/planner").json()["caches"][0]["cached_tokens"] > 50
    files = [r[0] for r in query(server.db_path, "SELECT record_path FROM caches WHERE agent_id = 'planner'")]
    assert files and all(os.path.exists(f) for f in files)

    assert api.delete("/v1/agents/planner").status_code == 204
    assert api.get("/v1/agents/planner").status_code == 404
    assert query(server.db_path, "SELECT count(*) FROM caches WHERE agent_id = 'planner'") == [(0,)]
    assert not any(os.path.exists(f) for f in files)
    assert "planner" not in json.dumps(api.get("/v1/agents").json())


def test_unknown_agent_and_bad_bodies(server: ServerProcess) -> None:
    api = httpx.Client(base_url=server.url, timeout=60)
    missing = api.post("/v1/agents/nobody/generate", json={"messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    api.post("/v1/agents", json={"id": "strict"})
    bad = api.post("/v1/agents/strict/generate", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("messages:")


def test_without_prefill_the_first_turn_is_cold(server: ServerProcess) -> None:
    api = httpx.Client(base_url=server.url, timeout=120)
    created = api.post("/v1/agents", json={"id": "lazy", "system_prompt": "You are lazy.", "prefill": False,
                                           "ttl_seconds": 600, "metadata": {"team": "ops"}}).json()
    assert created["tier"] == "cold" and created["caches"] == []
    assert created["ttl_seconds"] == 600 and created["metadata"] == {"team": "ops", "system_prompt": "You are lazy."}
    first = api.post("/v1/agents/lazy/generate", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4}).json()
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert api.get("/v1/agents/lazy").json()["tier"] == "hot"


def test_create_validates_its_body(server: ServerProcess) -> None:
    api = httpx.Client(base_url=server.url, timeout=60)
    for body, field in [({"id": "has space"}, "id"), ({"ttl_seconds": 0}, "ttl_seconds"),
                        ({"system_prompt": 5}, "system_prompt"), ({"prefill": "yes"}, "prefill")]:
        response = api.post("/v1/agents", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["message"].startswith(field + ":"), response.json()
    too_long = api.post("/v1/agents", json={"id": "huge", "system_prompt": "word " * 9000})
    assert too_long.status_code == 400 and "prompt is too long" in too_long.json()["error"]["message"]
    assert api.get("/v1/agents/huge").status_code == 404  # nothing half-created
