"""`semantic chat`: a terminal chat with an agent of the running server (found from the
home), each reply streamed and followed by its cache line; /agents, /new and /quit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

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


def test_a_question_on_the_command_line_is_answered_once(server: ServerProcess) -> None:
    """`semantic chat "question"`, the `ollama run` habit: answered, then exit (it was a 400
    about the agent id's pattern)."""
    done = chat(server, "", "What is the capital of France?", "--max-tokens", "8", "--temperature", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Paris" in done.stdout and STATS.match(done.stderr.strip()), (done.stdout, done.stderr)
    named = chat(server, "", "chat-once", "What is the capital of Italy?", "--max-tokens", "8", "--temperature", "0")
    assert named.returncode == 0 and named.stdout.strip(), named.stderr
    history = httpx.get(f"{server.url}/v1/agents/chat-once/history", timeout=30).json()["messages"]
    assert history[0]["content"] == "What is the capital of Italy?"


def test_a_block_between_triple_quotes_is_one_turn(server: ServerProcess) -> None:
    script = '"""\nRead this:\ndef f(x):\n    return x + 1\n"""\n/quit\n'
    done = chat(server, script, "chat-block", "--max-tokens", "2", "--temperature", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    history = httpx.get(f"{server.url}/v1/agents/chat-block/history", timeout=30).json()["messages"]
    assert [m["content"] for m in history if m["role"] == "user"] == ["Read this:\ndef f(x):\n    return x + 1"]


def test_in_a_terminal_input_is_edited_pasted_whole_and_never_cut(server: ServerProcess) -> None:
    """Issue 62: in a real terminal (a pty), a left arrow was stored as ``\\x1b[D``, a paste of
    4 lines became 4 turns without their indentation, and a 10,558-character paste was cut
    to 4,095 characters (the terminal's line limit). readline edits the line, bracketed
    paste makes a paste one turn, and raw mode reads past the limit. The long turn's prefill
    shows its progress bar."""
    import pty
    import select

    env = {**os.environ, "SEMANTIC_HOME": str(server.home), "TERM": "xterm"}
    env.pop("SEMANTIC_PORT", None)
    fd, tty = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "app", "chat", "chat-tty", "--max-tokens", "1", "--temperature",
                              "0"], stdin=tty, stdout=tty, stderr=tty, cwd=ROOT, env=env, start_new_session=True)
    os.close(tty)
    seen = b""

    def wait_for(pattern: bytes, count: int, timeout_s: float = 120) -> None:
        """Until the output holds ``pattern`` ``count`` times."""
        nonlocal seen
        deadline = time.monotonic() + timeout_s
        while seen.count(pattern) < count:
            assert time.monotonic() < deadline, (child.poll(), seen[-2000:])
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break

    try:
        wait_for(b"> ", 1)
        os.write(fd, b"abc\x1b[DX\r")  # a left arrow, then X: "abXc"
        wait_for(b"tokens from cache", 1)
        wait_for(b"> ", 2)
        pasted = "\n".join(["def g(y):", "    z = y * 2", "    return z", "# end"])
        os.write(fd, b"\x1b[200~" + pasted.encode() + b"\x1b[201~\r")
        wait_for(b"tokens from cache", 2)
        wait_for(b"> ", 3)
        long = " ".join(f"word{i}" for i in range(1300))  # ~10,000 characters on one line
        for start in range(0, len(long), 1024):
            os.write(fd, long[start:start + 1024].encode())
            time.sleep(0.05)
        os.write(fd, b"\r")
        wait_for(b"tokens from cache", 3, 300)
        assert re.search(rb"\[prefill #*\.* +\d+%  \d+/\d+ prompt tokens\]", seen), seen[-3000:]  # its long prefill
        os.write(fd, b"/quit\r")
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(fd)
    history = httpx.get(f"{server.url}/v1/agents/chat-tty/history", timeout=30).json()["messages"]
    asked = [m["content"] for m in history if m["role"] == "user"]
    assert asked == ["abXc", pasted, long], [a[:80] for a in asked]
