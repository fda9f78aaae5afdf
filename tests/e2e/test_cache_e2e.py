"""Cache reuse seen by real clients of a real server: usage, SQL rows, restarts."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query, request_row, wait_persisted

GREEDY = {"temperature": 0}
SYSTEM = "You are a terse assistant for a hardware store. " + "Always answer in one short sentence. " * 50


def client_for(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)


def ask(server: ServerProcess, history: list[dict], session: str | None = None) -> anthropic.types.Message:
    headers = {"X-Claude-Code-Session-Id": session} if session else {}
    return client_for(server).messages.create(model="claude-sonnet-5", max_tokens=24, system=SYSTEM,
                                              messages=history, extra_body=GREEDY, extra_headers=headers)


def three_turns(server: ServerProcess, session: str) -> list[anthropic.types.Message]:
    history = [{"role": "user", "content": "Do you sell hammers?"}]
    first = ask(server, history, session)
    history += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And nails?"}]
    second = ask(server, history, session)
    return [first, second]


def total_input(message: anthropic.types.Message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_second_turn_reads_the_first_from_cache(server: ServerProcess) -> None:
    session = str(uuid.uuid4())
    first, second = three_turns(server, session)
    assert first.usage.cache_creation_input_tokens == total_input(first)
    # Turn 1's prompt and reply were reused; only the new user turn was prefilled.
    assert second.usage.cache_read_input_tokens >= total_input(first) + first.usage.output_tokens - 1
    assert second.usage.cache_creation_input_tokens < 30
    rows = query(server.db_path, "SELECT reuse_reason, n_cached_tokens, n_input_tokens FROM requests "
                 "WHERE agent_id = ? ORDER BY created_at", session)
    assert [r[0] for r in rows] == ["miss", "extend"]
    assert rows[1][1] == second.usage.cache_read_input_tokens and rows[1][2] == total_input(second)
    health = httpx.get(f"{server.url}/health").json()["cache"]
    assert health["reuse"] and health["pool_bytes"] > 0 and health["agents"]["hot"] >= 1


def test_stateless_requests_are_resumed_by_content(server: ServerProcess) -> None:
    client = client_for(server)

    def stateless(history: list[dict]) -> tuple[anthropic.types.Message, dict]:
        raw = client.messages.with_raw_response.create(model="m", max_tokens=24, system=SYSTEM, messages=history,
                                                       extra_body=GREEDY)
        return raw.parse(), request_row(server.db_path, raw.headers["request-id"])

    history = [{"role": "user", "content": f"Quote {uuid.uuid4().hex[:6]}: do you sell saws?"}]
    first, first_row = stateless(history)
    wait_persisted(server.db_path, first_row["agent_id"], total_input(first))
    history += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Which brands?"}]
    second, second_row = stateless(history)
    assert second_row["agent_id"] == first_row["agent_id"]
    assert query(server.db_path, "SELECT origin FROM agents WHERE id = ?", first_row["agent_id"]) == [("content",)]
    assert second.usage.cache_read_input_tokens >= total_input(first)
    # A different conversation with the same system prompt is another agent (sharing blocks).
    other, other_row = stateless([{"role": "user", "content": "Do you cut keys?"}])
    assert other_row["agent_id"] != first_row["agent_id"] and other_row["reuse_reason"] == "shared"


@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_resumes_from_disk(tmp_path: Path, smollm2_dir: Path, kill: signal.Signals) -> None:
    baseline = start_server(tmp_path / "baseline", smollm2_dir)
    try:
        first, second = three_turns(baseline, "s")
        history = [{"role": "user", "content": "Do you sell hammers?"},
                   {"role": "assistant", "content": first.content[0].text},
                   {"role": "user", "content": "And nails?"},
                   {"role": "assistant", "content": second.content[0].text},
                   {"role": "user", "content": "Thanks, bye."}]
        expected = ask(baseline, history, "s")
    finally:
        stop_server(baseline)

    server = start_server(tmp_path / "restarted", smollm2_dir)
    three_turns(server, "s")
    wait_persisted(server.db_path, "s", total_input(second) + second.usage.output_tokens)
    os.kill(server.process.pid, kill)
    server.process.wait(timeout=30)
    server = start_server(tmp_path / "restarted", smollm2_dir)
    try:
        third = ask(server, history, "s")
        assert third.usage.cache_read_input_tokens == expected.usage.cache_read_input_tokens > 0
        assert third.content[0].text == expected.content[0].text
        assert query(server.db_path, "SELECT reuse_reason FROM requests ORDER BY created_at DESC LIMIT 1") == [("extend",)]
        # Each start's log is kept: the killed server's beside this one's.
        earlier = (server.home / "server.log.1").read_text()
        assert server.log().count(" ready, BLAS") == earlier.count(" ready, BLAS") == 1
        assert "cached tokens from disk" in server.log() and "cached tokens from disk" not in earlier
    finally:
        stop_server(server)


def test_reuse_can_be_switched_off(tmp_path: Path, smollm2_dir: Path) -> None:
    server = start_server(tmp_path, smollm2_dir, {"SEMANTIC_CACHE_REUSE": "0"})
    try:
        _, second = three_turns(server, "off")
        assert second.usage.cache_read_input_tokens == 0 and second.usage.cache_creation_input_tokens == 0
        assert second.usage.input_tokens > 100
        assert httpx.get(f"{server.url}/health").json()["cache"]["reuse"] is False
    finally:
        stop_server(server)
