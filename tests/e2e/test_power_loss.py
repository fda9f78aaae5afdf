"""A simulated power cut: every answered turn's history survives, and no cache file a row
points at is missing or damaged afterwards (docs/operations.md, "What a fault can cost").

The server runs under tests/support/powercut (an fsync journal); after SIGKILL its home is
rebuilt as a disk that kept only what was fsynced would hold it, and a new server starts
on that home.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import httpx

from support.servers import start_server, stop_server
from support import powercut
from support.dbcheck import wait_persisted
from support.store_check import store_problems

SYSTEM = "You are a terse assistant for a bicycle shop. Answer in one sentence."
QUESTIONS = ["Do you fix flat tyres?", "How long does it take?", "Do you sell helmets?"]
GREEDY = {"max_tokens": 16, "temperature": 0}
EXACT = {"SEMANTIC_KV_FORMAT": "f32"}  # the exact format: a sound cache answers as a cold prefill, token for token


def _turn(api: httpx.Client, agent_id: str, question: str | list[dict]) -> dict:
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    response = api.post(f"/v1/agents/{agent_id}/generate", json={"messages": messages, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_power_cut_keeps_every_answered_turn_and_no_cache_row_points_at_a_lost_file(
        tmp_path: Path, smollm2_dir: Path) -> None:
    home = tmp_path / "home"
    # The baseline: a home a clean shutdown left (the database created, the model known).
    stop_server(start_server(home, smollm2_dir, EXACT))
    cut = powercut.Cut(home, tmp_path / "cut", powercut.build(tmp_path / "shim"))

    server = start_server(home, smollm2_dir, {**EXACT, **cut.env()})
    api = httpx.Client(base_url=server.url, timeout=300)
    assert api.post("/v1/agents", json={"id": "shop", "system_prompt": SYSTEM}).status_code == 201
    replies = [_turn(api, "shop", q) for q in QUESTIONS]
    answers = [reply["content"][0]["text"] for reply in replies]
    last = replies[-1]["usage"]
    # The last answered turn's extent: its whole prompt and its reply (but the final token,
    # which decoding never feeds back), in the cache and on disk before the power goes.
    extent = sum(last[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")) \
        + last["output_tokens"] - 1
    wait_persisted(home / "semantic.db", "shop", extent)
    # The power goes while a fourth turn is being generated: a stream, cut mid-answer.
    with api.stream("POST", "/v1/agents/shop/generate", json={
            "messages": [{"role": "user", "content": "Tell me about your opening hours in detail."}],
            "max_tokens": 400, "temperature": 0, "stream": True}) as stream:
        assert next(stream.iter_lines())  # generation is under way
        os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    assert cut.rebuild() > 0  # the journal saw the server's syncs

    connection = sqlite3.connect(home / "semantic.db")
    try:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        connection.close()
    assert store_problems(home) == []  # no row points at a missing or damaged file

    server = start_server(home, smollm2_dir, EXACT)
    try:
        api = httpx.Client(base_url=server.url, timeout=300)
        response = api.get("/v1/agents/shop/history")
        assert response.status_code == 200, response.text  # the agent's creation survived
        messages = response.json()["messages"]
        assert [m["content"] for m in messages[:6:2]] == QUESTIONS
        assert [m["content"][0]["text"] for m in messages[1:6:2]] == answers
        assert len(messages) == 6  # the turn the cut interrupted was never answered, never stored
        after = _turn(api, "shop", "Thanks, bye.")
        # The synced cache was read, all of the last answered turn (the system prompt alone,
        # a few hundred tokens less, would pass a weaker check).
        assert after["usage"]["cache_read_input_tokens"] >= extent, (after["usage"], extent)
        # The same conversation sent whole to an agent with nothing cached answers the same:
        # whatever the cut left of the cache was either sound or not used.
        api.post("/v1/agents", json={"id": "shop-cold", "system_prompt": SYSTEM, "prefill": False})
        replay = [{"role": m["role"], "content": m["content"]} for m in messages]
        cold = _turn(api, "shop-cold", [*replay, {"role": "user", "content": "Thanks, bye."}])
        assert cold["usage"]["cache_read_input_tokens"] == 0
        assert cold["content"] == after["content"]
    finally:
        stop_server(server)
