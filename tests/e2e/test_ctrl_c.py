"""Ctrl-C on a real `semantic serve` in the middle of a streamed answer: the first SIGINT says
what it waits for and cancels the generation, the process exits by itself within seconds
(130, no C++ abort), and the interrupted request is recorded as cancelled with no history; a
second SIGINT exits at once (issue 40, item 2)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from support.servers import ServerProcess, start_server
from support.dbcheck import query

LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 60
ASK = "Repeat the text above twenty times, then count from 1 to 2000."


def stream_long_answer(server: ServerProcess, session: str, received: list[bytes]) -> threading.Thread:
    """A streamed request that would run for minutes (max_tokens 4000), read until the server ends it."""
    def read() -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/messages", timeout=120, headers={"x-session-id": session},
                              json={"model": "m", "max_tokens": 4000, "temperature": 0, "stream": True,
                                    "messages": [{"role": "user", "content": f"{LONG}\n{ASK}"}]}) as response:
                for chunk in response.iter_bytes():
                    received.append(chunk)
        except httpx.TransportError:
            pass  # the server went away: what counts is that the read ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def wait_generating(server: ServerProcess, received: list[bytes], timeout_s: float = 120) -> None:
    """Until the answer's first text has been streamed (the generation is under way)."""
    deadline = time.monotonic() + timeout_s
    while b"text_delta" not in b"".join(received):
        assert time.monotonic() < deadline and server.process.poll() is None, server.log()
        time.sleep(0.1)


def exited_within(process: subprocess.Popen, seconds: float) -> int | None:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def test_ctrl_c_cancels_the_answer_records_it_and_exits(tmp_path: Path, smollm2_dir: Path) -> None:
    server = start_server(tmp_path / "home", smollm2_dir)
    try:
        received: list[bytes] = []
        reader = stream_long_answer(server, "interrupted", received)
        wait_generating(server, received)
        interrupted = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        code = exited_within(server.process, 15)  # by itself: nothing left to drain
        assert code == 130, f"exit {code} after {time.monotonic() - interrupted:.1f} s\n{server.log()}"
        reader.join(10)
        assert not reader.is_alive()
        log = server.log()
        assert "Ctrl-C: cancelling 1 request(s)" in log and "Ctrl-C again to stop now" in log
        assert "terminate called" not in log
        # The client got an end, not a cut, and not one that looks finished (end_turn, issue 62).
        got = b"".join(received)
        assert b"event: error" in got and b"was cancelled before its reply ended" in got, got[-500:]
        assert b"end_turn" not in got and b"message_stop" not in got
        assert query(server.db_path, "SELECT status, stop_reason FROM requests WHERE agent_id = 'interrupted'") == \
            [("cancelled", "cancelled")]
        assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = 'interrupted'") == [(0,)]
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_a_second_ctrl_c_exits_at_once_without_an_abort(tmp_path: Path, smollm2_dir: Path) -> None:
    server = start_server(tmp_path / "home", smollm2_dir)
    try:
        received: list[bytes] = []
        stream_long_answer(server, "interrupted", received)
        wait_generating(server, received)
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.2)
        server.process.send_signal(signal.SIGINT)
        assert exited_within(server.process, 5) == 130, server.log()
        assert "terminate called" not in server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()
