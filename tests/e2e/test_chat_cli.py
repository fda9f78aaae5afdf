"""`semantic chat`: a terminal chat with an agent of the running server (found from the
home), each reply streamed and followed by its cache line; /agents, /new and /quit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx

from conftest import ROOT
from support.servers import ServerProcess

STATS = re.compile(r"^\[(\d+)/(\d+) prompt tokens from cache, first token ([\d.]+) s, (\d+) tokens")


def chat(server: ServerProcess, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SEMANTIC_HOME": str(server.home)}  # no port: the chat reads the home's serve.json
    env.pop("SEMANTIC_PORT", None)
    return subprocess.run([sys.executable, "-m", "app", "chat", *args], input=script, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_chat_streams_its_turns_warm_and_runs_its_commands(server: ServerProcess) -> None:
    script = "What is the capital of France?\nAnd of Italy?\n/agents\n/new chat-second\nHello there.\n/bogus\n/quit\n"
    done = chat(server, script, "chat-first", "--max-tokens", "8", "--temperature", "0",
                "--system", "You answer in one short sentence.")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert "agent chat-first (new); /help for commands" in out
    assert "agent chat-second (new); /help for commands" in out
    stats = [m for line in out if (m := STATS.match(line))]
    assert len(stats) == 3, done.stdout
    (cached_1, prompt_1, *_), (cached_2, prompt_2, *_) = [tuple(int(float(g)) for g in m.groups()) for m in stats[:2]]
    assert cached_1 > 0  # the system prompt, prefilled when the chat created the agent
    assert cached_2 >= prompt_1 - 1  # the second turn reads the whole first one from cache
    assert prompt_2 > prompt_1
    assert any(line.startswith("chat-first  4 messages  hot") for line in out), done.stdout  # /agents, before /new
    assert "unknown command /bogus; /help lists them" in out

    history = httpx.get(f"{server.url}/v1/agents/chat-first/history", timeout=30).json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[2]["content"] == "And of Italy?"
    reply = next(line for line in out[out.index("agent chat-first (new); /help for commands") + 1:] if line)
    stored = "".join(block["text"] for block in history[1]["content"] if block["type"] == "text")
    assert reply == stored.strip()  # what streamed is what was stored
    again = chat(server, "One more?\n", "chat-first", "--max-tokens", "4", "--temperature", "0")
    assert "agent chat-first (continuing its latest conversation); /help for commands" in again.stdout
    assert len(httpx.get(f"{server.url}/v1/agents/chat-first/history", timeout=30).json()["messages"]) == 6


def test_a_chat_says_when_no_server_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "SEMANTIC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "app", "chat", "--url", "http://127.0.0.1:9"], input="hi\n", cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "no server answers at http://127.0.0.1:9" in done.stdout and "semantic serve" in done.stdout
