"""A hybrid model (Qwen3.5's shape: linear-attention layers keeping recurrent state beside
attention layers) served by a real ``semantic serve``: every later turn of an agent reuses
its previous turns (the recurrent state from the checkpoints in the conversation's record,
app/cache/checkpoints.py), after a SIGKILL too, with the same greedy text as a fresh server
prefilling the whole conversation; an exported agent keeps its checkpoints on import; and
another agent with the same system prompt resumes from the first one's shared checkpoint at
a block boundary (app/cache/manager.py), with a fresh server's text; and in a pool, an
agent whose server is killed goes on warm on the other one, from the shared tier.

The model is tiny and random (tests/support/families.py); ``f32`` KV keeps warm and cold
bit-identical, so the texts must match exactly.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from app.cache.blocks import BLOCK_TOKENS
from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query, wait_persisted
from support.families import save
from test_cli import semantic

F32 = {"SEMANTIC_KV_FORMAT": "f32"}
SYSTEM = "You are a terse assistant for a garden centre. " + " ".join(
    f"Rule {i}: answer in one short sentence about plants, soil, tools, seeds or opening hours." for i in range(40))
QUESTIONS = ["Do you sell basil?", "What soil for tomatoes?", "Which spade is best?", "When do you open?",
             "Any roses in stock?"]
AFTER_RESTART = {"role": "user", "content": "Thanks, what about seeds?"}
MIN_REUSE = 0.95


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return save("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "qwen3_5", smollm2_dir)


@pytest.fixture
def fresh(tmp_path: Path, hybrid_dir: Path) -> Iterator[ServerProcess]:
    """A server that has never seen the conversation (its reference answer is all cold)."""
    running = start_server(tmp_path / "fresh", hybrid_dir, F32)
    yield running
    stop_server(running)


def _turn(api: httpx.Client, agent_id: str, message: dict) -> dict:
    response = api.post(f"/v1/agents/{agent_id}/generate",
                        json={"messages": [message], "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _prompt(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def _reuse(body: dict) -> float:
    return body["usage"]["cache_read_input_tokens"] / _prompt(body["usage"])


def _conversation(server: ServerProcess, agent_id: str) -> list[dict]:
    """An agent's turns, each user question asked and answered (reuse checked from the second)."""
    api = httpx.Client(base_url=server.url, timeout=120)
    assert api.post("/v1/agents", json={"id": agent_id, "system_prompt": SYSTEM}).status_code == 201
    turns = [_turn(api, agent_id, {"role": "user", "content": q}) for q in QUESTIONS]
    for number, body in enumerate(turns[1:], 2):
        assert _reuse(body) >= MIN_REUSE, (number, body["usage"])
    last = turns[-1]["usage"]
    wait_persisted(server.db_path, agent_id, _prompt(last) + last["output_tokens"] - 1)
    return turns


def _cold_answer(server: ServerProcess, history: list[dict]) -> dict:
    """The whole conversation sent to ``server`` in one request (nothing of it cached there)."""
    response = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
        "model": "default", "max_tokens": 12, "temperature": 0, "system": SYSTEM, "messages": history})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["cache_read_input_tokens"] == 0
    return body


def _history(server: ServerProcess, agent_id: str) -> list[dict]:
    messages = httpx.get(f"{server.url}/v1/agents/{agent_id}/history").json()["messages"]
    return [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] in ("user", "assistant")]


def test_a_hybrid_agent_reuses_every_turn_and_after_a_sigkill_answers_as_a_fresh_server(
        tmp_path: Path, hybrid_dir: Path, fresh: ServerProcess) -> None:
    server = start_server(tmp_path / "home", hybrid_dir, F32)
    try:
        _conversation(server, "gardener")
        history = _history(server, "gardener")
    finally:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
    assert len(history) == 2 * len(QUESTIONS)

    server = start_server(tmp_path / "home", hybrid_dir, F32)
    try:
        resumed = _turn(httpx.Client(base_url=server.url, timeout=120), "gardener", AFTER_RESTART)
    finally:
        stop_server(server)
    expected = _cold_answer(fresh, [*history, AFTER_RESTART])
    assert _prompt(resumed["usage"]) == _prompt(expected["usage"])
    assert _reuse(resumed) >= MIN_REUSE, resumed["usage"]
    assert resumed["content"] == expected["content"]


def test_an_exported_hybrid_agent_keeps_its_checkpoints_on_import(
        tmp_path: Path, hybrid_dir: Path, fresh: ServerProcess) -> None:
    server = start_server(tmp_path / "home", hybrid_dir, F32)
    try:
        _conversation(server, "gardener")
        archive = tmp_path / "gardener.tar"
        exported = semantic(server.home, "agents", "export", "gardener", "-o", str(archive))
        assert exported.returncode == 0, exported.stderr
        here = _turn(httpx.Client(base_url=server.url, timeout=120), "gardener", AFTER_RESTART)
    finally:
        stop_server(server)

    imported = semantic(fresh.home, "agents", "import", str(archive))
    assert imported.returncode == 0, imported.stderr
    there = _turn(httpx.Client(base_url=fresh.url, timeout=120), "gardener", AFTER_RESTART)
    assert _reuse(there) >= MIN_REUSE, there["usage"]
    assert there["usage"]["cache_read_input_tokens"] == here["usage"]["cache_read_input_tokens"]
    assert there["content"] == here["content"]


def _first_turn(server: ServerProcess, session: str, question: str) -> dict:
    """A new conversation of agent ``session`` (named by ``X-Session-ID``) with ``SYSTEM``."""
    response = httpx.post(f"{server.url}/v1/messages", timeout=120, headers={"X-Session-ID": session}, json={
        "model": "default", "max_tokens": 12, "temperature": 0, "system": SYSTEM,
        "messages": [{"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response.json()


def test_another_agent_resumes_the_shared_system_prompt_at_a_block_boundary_as_a_fresh_server_answers(
        tmp_path: Path, hybrid_dir: Path, fresh: ServerProcess) -> None:
    server = start_server(tmp_path / "home", hybrid_dir, F32)
    try:
        _first_turn(server, "planner", QUESTIONS[0])
        reviewer = _first_turn(server, "reviewer", QUESTIONS[1])
    finally:
        stop_server(server)
    rows = query(server.db_path, "SELECT agent_id, reuse_reason, n_cached_tokens, n_input_tokens FROM requests "
                 "ORDER BY created_at")
    assert [row[:2] for row in rows] == [("planner", "miss"), ("reviewer", "shared")]
    n_cached, n_input = rows[1][2:]
    # The shared start is the system prompt (over 3 blocks): the reviewer resumes at the last
    # whole block of it, where the planner's prefill left a shared checkpoint.
    assert n_cached == reviewer["usage"]["cache_read_input_tokens"] == 3 * BLOCK_TOKENS < n_input, rows
    expected = _first_turn(fresh, "reviewer", QUESTIONS[1])
    assert expected["usage"]["cache_read_input_tokens"] == 0
    assert reviewer["content"] == expected["content"]


def test_a_hybrid_agent_whose_server_dies_moves_to_another_server_of_a_pool_warm_from_the_tier(
        tmp_path: Path, hybrid_dir: Path, fresh: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """`semantic pool up` (PostgreSQL, S3, HAProxy, two servers) on the hybrid model: after
    its server is killed, an agent's next turn is served by the other server, which reads
    the conversation's blocks and recurrent-state checkpoints from the shared tier, reuses
    at least 90% of the previous prompt and answers as a fresh server prefilling it all."""
    from test_pool import SYSTEM as POOL_SYSTEM
    from test_pool import prompt_tokens, running_pool, wait_uploaded
    from test_pool import turn as pool_turn

    with running_pool(tmp_path, hybrid_dir, monkeypatch, 2, config='kv_format = "f32"\n') as (_home, state, _pool):
        router, history, servers = state["router"], [], set()
        for question in QUESTIONS[:3]:
            history.append({"role": "user", "content": question})
            server, reply, usage = pool_turn(router, "hybrid-agent", history)
            history.append({"role": "assistant", "content": reply})
            servers.add(server)
        (held,) = servers
        before = prompt_tokens(usage)  # the last prompt before the kill
        wait_uploaded(state, "hybrid-agent", before - 1)
        os.kill(next(s["pid"] for s in state["servers"] if s["id"] == held), signal.SIGKILL)
        history.append(AFTER_RESTART)
        server, reply, usage = pool_turn(router, "hybrid-agent", history)
        assert server != held
        assert usage["cache_read_input_tokens"] >= 0.9 * before, usage  # restored from the shared tier

    cold = httpx.post(f"{fresh.url}/v1/messages", timeout=120, json={
        "model": "default", "max_tokens": 8, "temperature": 0, "system": POOL_SYSTEM, "messages": history})
    assert cold.status_code == 200 and cold.json()["usage"]["cache_read_input_tokens"] == 0, cold.text
    assert reply == cold.json()["content"][0]["text"]
