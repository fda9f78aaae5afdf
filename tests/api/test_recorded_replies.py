"""What a turn records is the reply its protocol built once (whole, or as the stream sent
it), and a Responses turn continues a stored one (``previous_response_id``), through the API
on a fake engine with the real store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import falcon.testing
import pytest

from app.agents.service import AgentService
from app.errors import StoreBusy
from support.dbcheck import query
from support.fake_engine import FakeEngine, make_app

RESPONSE = {"model": "gpt-x", "input": "Say hi.", "max_output_tokens": 8}
MESSAGES = {"model": "claude-sonnet-5", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}


@pytest.fixture
def app(tmp_path: Path) -> tuple[falcon.testing.TestClient, FakeEngine, Path]:
    return make_app(tmp_path)


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_streamed_response_is_stored_as_sent_and_continued_by_its_id(app) -> None:  # type: ignore[no-untyped-def]
    client, engine, db = app
    streamed = client.simulate_post("/v1/responses", json={**RESPONSE, "stream": True})
    events = sse_events(streamed.text)
    assert events[-1]["type"] == "response.completed"
    sent = events[-1]["response"]
    stored = client.simulate_get(f"/v1/responses/{sent['id']}")
    assert stored.status_code == 200 and stored.json == sent
    follow = client.simulate_post("/v1/responses",
                                  json={**RESPONSE, "input": "Again.", "previous_response_id": sent["id"]})
    assert follow.status_code == 200 and follow.json["previous_response_id"] == sent["id"]
    first, second = engine.submitted[-2:]
    assert (second.agent_id, second.conversation_id) == (first.agent_id, first.conversation_id)
    rows = query(db, f"SELECT role, content FROM messages WHERE conversation_id = '{first.conversation_id}' "
                     "ORDER BY position")
    assert [(role, json.loads(content)) for role, content in rows] == [
        ("user", {"role": "user", "content": "Say hi."}), ("assistant", sent["output"][0]),
        ("user", {"role": "user", "content": "Again."}), ("assistant", follow.json["output"][0])]
    assert client.simulate_get(f"/v1/responses/{follow.json['id']}").json == follow.json


def test_a_stream_whose_history_write_fails_ends_as_its_protocol_ends_a_failure(app, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Responses API's stream ends with ``response.failed`` (its renderer's own ending),
    the Messages API's with an ``error`` event; the request is recorded as failed."""
    client, engine, db = app

    def busy(*args: Any, **kwargs: Any) -> None:
        raise StoreBusy("the database stayed locked")

    monkeypatch.setattr(AgentService, "complete", busy)
    streamed = client.simulate_post("/v1/responses", json={**RESPONSE, "stream": True})
    events = sse_events(streamed.text)
    assert [e["type"] for e in events][-1] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "the database stayed locked"
    assert not any(e["type"] == "response.completed" for e in events)
    messages = client.simulate_post("/v1/messages", json={**MESSAGES, "stream": True})
    assert sse_events(messages.text)[-1] == {"type": "error", "error": {"type": "api_error",
                                                                        "message": "the database stayed locked"}}
    assert "message_stop" not in messages.text
    assert query(db, "SELECT protocol, status FROM requests ORDER BY created_at") == [("responses", "error"), ("anthropic", "error")]
