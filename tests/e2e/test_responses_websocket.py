"""The Responses API's WebSocket transport against a real server with the embedded model and a
real WebSocket client (the ``websockets`` library): a warm-up, two turns on one connection (the
second sending only its new input), events as the SSE path sends them, the cache reused, bad
messages answered with ``error`` events on a connection that stays usable."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from support.servers import ServerProcess
from support.dbcheck import query

DONE = ("response.completed", "response.incomplete")
SYSTEM = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]}]


def receive_turn(ws: ClientConnection) -> list[dict[str, Any]]:
    """Events up to a response's last one (or an error)."""
    events: list[dict[str, Any]] = []
    while True:
        events.append(json.loads(ws.recv(timeout=300)))
        if events[-1]["type"] in (*DONE, "error", "response.failed"):
            return events


def without_keep_alives(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events but the repeated ``response.in_progress`` a prefill sends as it progresses
    (on either transport, as its timing goes)."""
    return [e for i, e in enumerate(events) if i < 2 or e["type"] != "response.in_progress"]


def sse_events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    # An agent of its own: prefilled afresh, as the WebSocket's first turn was (a reused 4-bit
    # cache may tip a greedy choice).
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=300,
                      headers={"X-Session-ID": "sse-twin"}) as answer:
        assert answer.status_code == 200
        return [json.loads(line[len("data: "):]) for line in answer.iter_lines() if line.startswith("data: ")]


def test_two_turns_on_one_connection_send_only_new_input(server: ServerProcess) -> None:
    turn = {"model": "gpt-5", "temperature": 0, "max_output_tokens": 8, "store": False}
    with connect(server.url.replace("http://", "ws://") + "/v1/responses") as ws:
        # A warm-up (Codex's first message): nothing runs, its id continues from its input.
        ws.send(json.dumps({"type": "response.create", **turn, "input": SYSTEM, "generate": False}))
        warm = receive_turn(ws)
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
        assert warm[-1]["response"]["output"] == []
        warm_id = warm[-1]["response"]["id"]

        ws.send(json.dumps({"type": "response.create", **turn, "previous_response_id": warm_id,
                            "input": "What is the capital of France?"}))
        first = receive_turn(ws)
        done_1 = first[-1]["response"]
        assert first[-1]["type"] in DONE and done_1["previous_response_id"] == warm_id

        # Newer Codex versions acknowledge a response: taken without an answer.
        ws.send(json.dumps({"type": "response.processed", "response_id": done_1["id"]}))
        # A message of another type, one that is not JSON, an unknown response: error events.
        for bad, status, param in (({"type": "response.cancel"}, 400, "type"), ("not json", 400, "body"),
                                   ({"type": "response.create", **turn, "previous_response_id": "resp_nope",
                                     "input": "hi"}, 404, None)):
            ws.send(bad if isinstance(bad, str) else json.dumps(bad))
            (error,) = receive_turn(ws)
            assert error["type"] == "error" and error["status"] == status, error
            assert error["error"]["param"] == param and error["error"]["message"]

        # The second turn sends only its new input; the connection still knows the first
        # response (store: false: nothing stored to look it up by).
        ws.send(json.dumps({"type": "response.create", **turn, "previous_response_id": done_1["id"],
                            "input": "And of Italy?"}))
        second = receive_turn(ws)
    done_2 = second[-1]["response"]
    assert second[-1]["type"] in DONE and done_2["previous_response_id"] == done_1["id"]
    # The whole first prompt came from the cache: only the new message was prefilled.
    assert done_2["usage"]["input_tokens_details"]["cached_tokens"] >= done_1["usage"]["input_tokens"]
    assert httpx.get(f"{server.url}/v1/responses/{done_1['id']}").status_code == 404  # store: false kept

    # The SSE path sends the same events for the same (whole) request.
    whole = [*SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    sse = sse_events(server, {**turn, "input": whole})
    assert [e["type"] for e in without_keep_alives(sse)] == [e["type"] for e in without_keep_alives(first)]
    assert [e.get("delta") for e in without_keep_alives(sse)] == [e.get("delta") for e in without_keep_alives(first)]

    # Both turns were recorded as Responses API requests, in one conversation, and came over the socket.
    rows = query(server.db_path, "SELECT id, conversation_id, n_cached_tokens, reuse_reason FROM requests "
                 "WHERE protocol = 'responses' AND status = 'ok' ORDER BY created_at DESC LIMIT 3")
    _, (second_id, conv_2, cached_2, reason_2), (first_id, conv_1, _, _) = rows
    assert conv_1 == conv_2 and reason_2 == "extend"
    assert cached_2 == done_2["usage"]["input_tokens_details"]["cached_tokens"]
    log = server.log()
    for request_id in (first_id, second_id):
        assert re.search(rf"WebSocket \w+: request {request_id} agent", log), request_id


def test_a_get_without_an_upgrade_is_a_400_in_the_responses_shape(server: ServerProcess) -> None:
    answer = httpx.get(f"{server.url}/v1/responses")
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error" and answer.json()["error"]["param"] == "upgrade"
