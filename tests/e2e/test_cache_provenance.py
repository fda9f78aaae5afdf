"""Cache provenance seen by real clients of a real server (SmolLM2): the ``x-semantic-cache``
header of every generation endpoint, streamed and not, the direct API's ``cache`` field,
``requests.cache_source`` and /status, through a first turn, a second, another agent sharing
the system prompt, and a restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx

from support.servers import ServerProcess, start_server, stop_server
from support.dbcheck import query, request_row, wait_persisted

HEADER = "x-semantic-cache"
GREEDY = {"temperature": 0}
KEYS = ["source", "reason", "tokens", "format"]


def provenance(headers: httpx.Headers) -> dict[str, str]:
    """The header's ``key=value; ...`` pairs, in order."""
    return dict(part.split("=", 1) for part in headers[HEADER].split("; "))


def kv_format(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/health").json()["kv_format"]["name"]


def long_system() -> str:
    """A system prompt of this test alone, over two blocks of 256 tokens."""
    return f"Store {uuid.uuid4().hex}. You are a terse assistant. " + "Always answer in one short sentence. " * 70


def ask(server: ServerProcess, system: str, history: list[dict], session: str) -> tuple[anthropic.types.Message,
                                                                                        dict[str, str]]:
    client = anthropic.Anthropic(base_url=server.url, api_key="dummy-key", max_retries=0)
    raw = client.messages.with_raw_response.create(model="claude-sonnet-5", max_tokens=12, system=system,
                                                   messages=history, extra_body=GREEDY,
                                                   extra_headers={"X-Claude-Code-Session-Id": session})
    return raw.parse(), provenance(raw.headers)


def ask_streamed(server: ServerProcess, system: str, history: list[dict],
                 session: str) -> tuple[str, int, dict[str, str]]:
    """A streamed turn: its text, message_start's cached tokens and the header as the
    response's head carried it."""
    body = {"model": "claude-sonnet-5", "max_tokens": 12, "system": system, "messages": history, "stream": True,
            **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=300,
                      headers={"X-Claude-Code-Session-Id": session}) as response:
        header = provenance(response.headers)  # known before any of the body is read
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[len("data: "):]) for line in lines]
    assert events[0]["type"] == "message_start"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    return text, events[0]["message"]["usage"]["cache_read_input_tokens"], header


def test_each_turn_says_where_its_cache_came_from(tmp_path: Path, smollm2_dir: Path) -> None:
    server = start_server(tmp_path, smollm2_dir)
    system = long_system()
    history: list[dict[str, Any]] = [{"role": "user", "content": "Do you sell hammers?"}]
    try:
        fmt = kv_format(server)
        first, header = ask(server, system, history, "p1")
        assert list(header) == KEYS
        assert header == {"source": "none", "reason": "miss", "tokens": "0", "format": fmt}

        history += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Nails?"}]
        second, header = ask(server, system, history, "p1")
        cached = second.usage.cache_read_input_tokens
        assert cached > 256
        assert header == {"source": "memory", "reason": "extend", "tokens": str(cached), "format": fmt}

        # Another agent with the same system prompt reads its whole blocks, still in memory.
        other, header = ask(server, system, [{"role": "user", "content": "Do you cut keys?"}], "p2")
        shared = other.usage.cache_read_input_tokens
        assert shared > 0 and shared % 256 == 0
        assert header == {"source": "memory", "reason": "shared", "tokens": str(shared), "format": fmt}

        # Streamed: the head waits for the lease (before prefill), so the header is the real one.
        history += [{"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "Saws?"}]
        reply, cached, header = ask_streamed(server, system, history, "p1")
        assert cached > 256
        assert header == {"source": "memory", "reason": "extend", "tokens": str(cached), "format": fmt}
        total = query(server.db_path, "SELECT n_input_tokens FROM requests ORDER BY created_at DESC LIMIT 1")[0][0]
        wait_persisted(server.db_path, "p1", total)
    finally:
        stop_server(server)

    server = start_server(tmp_path, smollm2_dir)  # memory is gone: the files on disk are left
    try:
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks, bye."}]
        after, header = ask(server, system, history, "p1")
        cached = after.usage.cache_read_input_tokens
        assert cached > 256
        assert header == {"source": "disk", "reason": "extend", "tokens": str(cached), "format": fmt}
        rows = query(server.db_path, "SELECT cache_source, reuse_reason FROM requests WHERE agent_id = 'p1' "
                     "ORDER BY created_at")
        assert rows == [("none", "miss"), ("memory", "extend"), ("memory", "extend"), ("disk", "extend")]
        page = httpx.get(f"{server.url}/status").text
        assert f"disk · extend · {cached} tokens" in page
        assert f"memory · shared · {shared} tokens" in page  # p2's latest turn, from before the restart
        # `semantic status` says the same, latest conversation first.
        env = {**os.environ, "SEMANTIC_HOME": str(server.home)}
        status = subprocess.run([sys.executable, "-m", "app", "status", "--url", server.url, "--json"],
                                capture_output=True, text=True, env=env, timeout=60)
        recent = json.loads(status.stdout)["recent"]
        assert [(r["agent_id"], r["source"], r["reason"], r["tokens"]) for r in recent[:2]] == [
            ("p1", "disk", "extend", cached), ("p2", "memory", "shared", shared)]
        text = subprocess.run([sys.executable, "-m", "app", "status", "--url", server.url],
                              capture_output=True, text=True, env=env, timeout=60).stdout
        assert f"p1/{recent[0]['conversation_id']}: disk (extend), {cached:,} tokens cached" in text
    finally:
        stop_server(server)


def test_every_generation_endpoint_carries_the_header_streamed_or_not(server: ServerProcess) -> None:
    fmt = kv_format(server)
    tag = uuid.uuid4().hex[:8]
    chat = [{"role": "user", "content": f"Ticket {tag}: say hi."}]
    requests = [
        ("/v1/chat/completions", {"model": "gpt-x", "max_tokens": 4, "messages": chat}),
        ("/v1/completions", {"model": "gpt-x", "max_tokens": 4, "prompt": f"Ticket {tag}: once upon a time"}),
        ("/v1/responses", {"model": "gpt-x", "max_output_tokens": 16, "input": f"Ticket {tag}: say hi."}),
        ("/api/chat", {"model": "smollm2-135m-instruct", "messages": chat, "options": {"num_predict": 4}}),
        ("/api/generate", {"model": "smollm2-135m-instruct", "prompt": f"Ticket {tag}: hi",
                           "options": {"num_predict": 4}}),
    ]
    for path, body in requests:
        for stream in (False, True):  # the streamed one repeats the request
            with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": stream},
                              timeout=300) as response:
                assert response.status_code == 200, (path, stream, response.read())
                header = provenance(response.headers)  # before the body
                response.read()
            row = request_row(server.db_path, response.headers["request-id"])
            assert list(header) == KEYS, (path, stream, header)
            assert header == {"source": row["cache_source"], "reason": row["reuse_reason"],
                              "tokens": str(row["n_cached_tokens"]), "format": fmt}, (path, stream, row)
            if not stream:  # its ticket is in no cache yet
                assert (header["source"], header["reason"], header["tokens"]) == ("none", "miss", "0"), path


def test_the_direct_api_gives_its_cache_field_and_header(server: ServerProcess) -> None:
    api = httpx.Client(base_url=server.url, timeout=300)
    agent = f"prov-{uuid.uuid4().hex[:8]}"
    assert api.post("/v1/agents", json={"id": agent, "system_prompt": long_system()}).status_code == 201
    response = api.post(f"/v1/agents/{agent}/generate",
                        json={"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4})
    body = response.json()
    cached = body["usage"]["cache_read_input_tokens"]
    assert cached > 256  # the system prompt, prefilled when the agent was made
    assert body["cache"] == {"source": "memory", "reason": "extend", "tokens": cached,
                             "format": kv_format(server)}
    assert provenance(response.headers) == {key: str(value) for key, value in body["cache"].items()}
