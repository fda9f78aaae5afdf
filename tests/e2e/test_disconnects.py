"""A client that leaves cancels its work: queued, during prefill, during decode, streaming or not.

Each case uses a prompt whose cold prefill takes tens of seconds on this machine
(about 3,000 tokens) and a client that gives up after a second or two. The
server must notice (waitress keeps reading the socket), stop between prefill
chunks or drop the queued job, record the request as cancelled, store no
history for it, and be free for the next request.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import httpx
import pytest

from support.servers import ServerProcess
from support.dbcheck import query

LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 130  # ~1,700 tokens: a 10 s prefill


def body(session: str, stream: bool, content: str = LONG, max_tokens: int = 8) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"{session}: {content}"}]}


def leave_after(server: ServerProcess, session: str, stream: bool, seconds: float) -> None:
    """Send a request and hang up after ``seconds``, before its answer: a stream's first
    events (message_start, pings, the prefill's progress comments) may come by then, no text."""
    with httpx.Client(timeout=httpx.Timeout(seconds, connect=5)) as client:
        if not stream:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{server.url}/v1/messages", json=body(session, stream), headers={"x-session-id": session})
            return
        deadline = time.monotonic() + seconds
        with client.stream("POST", f"{server.url}/v1/messages", json=body(session, stream),
                           headers={"x-session-id": session}) as response:
            try:
                for line in response.iter_lines():
                    assert "text_delta" not in line, "the answer began: the prefill was not long enough"
                    if time.monotonic() >= deadline:
                        break  # hang up
            except httpx.ReadTimeout:
                pass


def rows(server: ServerProcess, session: str) -> list[tuple]:
    return query(server.db_path, "SELECT status, stop_reason, n_output_tokens FROM requests WHERE agent_id = ?",
                 session)


def wait_finished(server: ServerProcess, session: str, timeout_s: float = 120) -> tuple:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = rows(server, session)
        if found and found[0][0] != "running":
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"request of {session} still running")


def assert_engine_free(server: ServerProcess) -> None:
    """A short request is served next (the engine is not still prefilling for a gone client)."""
    reply = httpx.post(f"{server.url}/v1/messages", json=body("after", False, "Say hi.", 4), timeout=120)
    assert reply.status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_leaving_during_prefill_stops_it_between_chunks(server: ServerProcess, stream: bool) -> None:
    session = f"gone-prefill-{uuid.uuid4().hex[:8]}"
    leave_after(server, session, stream, 2.0)
    status, stop_reason, n_output = wait_finished(server, session)
    assert (status, stop_reason) == ("cancelled", "cancelled") and not n_output
    assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(0,)]
    assert server.log().count("cancelled during prefill") >= 1
    assert_engine_free(server)


def test_a_retry_after_a_cancelled_prefill_resumes_from_what_it_computed(server: ServerProcess) -> None:
    """The client leaves part way through a long prefill (as Claude Code gave up on a slow one)
    and sends the same request again: the retry reads what the first attempt computed from the
    conversation's cache (issue 58: it read 17 of 9,392 tokens and started over)."""
    session = f"gone-retry-{uuid.uuid4().hex[:8]}"
    request = body(session, True, LONG * 3)  # ~5,000 tokens: a prefill of 15-40 s here
    with httpx.Client(timeout=httpx.Timeout(120, connect=5)) as client, \
            client.stream("POST", f"{server.url}/v1/messages", json=request,
                          headers={"x-session-id": session}) as response:
        for line in response.iter_lines():
            assert "text_delta" not in line, "the answer began: the prefill was not long enough"
            progress = re.match(r": prefill (\d+)/(\d+)", line)
            if progress and int(progress.group(1)) >= int(progress.group(2)) // 3:  # a third done: hang up
                break
    status, _, _ = wait_finished(server, session)
    assert status == "cancelled"
    (request_id,) = query(server.db_path, "SELECT id FROM requests WHERE agent_id = ?", session)[0]
    kept = rf"request {request_id}: cancelled during prefill \((\d+) of (\d+) prompt tokens computed, kept in its " \
           r"conversation's cache\)"
    deadline = time.monotonic() + 60  # the row says cancelled at once; the engine stops at its next chunk
    while (found := re.search(kept, server.log())) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found, server.log()[-3000:]
    computed, total = int(found.group(1)), int(found.group(2))
    assert 512 <= computed < total, (computed, total)  # cancelled part way
    retry = httpx.post(f"{server.url}/v1/messages", json=body(session, False, LONG * 3, max_tokens=1),
                       headers={"x-session-id": session}, timeout=300)
    assert retry.status_code == 200
    cached = retry.json()["usage"]["cache_read_input_tokens"]
    assert cached >= 0.95 * computed, (cached, computed, total)
    assert query(server.db_path, "SELECT status FROM requests WHERE agent_id = ? ORDER BY created_at",
                 session) == [("cancelled",), ("ok",)]


def test_leaving_while_queued_drops_the_job(server: ServerProcess) -> None:
    """A second client waits behind a long prefill and leaves: its job never runs."""
    first, second = (f"gone-queued-{i}-{uuid.uuid4().hex[:8]}" for i in range(2))
    busy = threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/messages", json=body(first, False, max_tokens=1),
                                                      headers={"x-session-id": first}, timeout=300))
    busy.start()
    time.sleep(1.0)
    leave_after(server, second, False, 1.5)
    busy.join()
    status, stop_reason, n_output = wait_finished(server, second)
    assert (status, stop_reason, n_output) == ("cancelled", "cancelled", 0)
    assert wait_finished(server, first)[0] == "ok"
    n_prompt = query(server.db_path, "SELECT n_input_tokens FROM requests WHERE agent_id = ?", second)[0][0]
    assert n_prompt > 1000  # rendered, queued, then dropped unprefilled


def test_leaving_during_decode_stops_generation(server: ServerProcess) -> None:
    """Streaming: the client reads a few tokens of a long answer and closes the connection."""
    session = f"gone-decode-{uuid.uuid4().hex[:8]}"
    request = {"model": "m", "max_tokens": 2000, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=request, headers={"x-session-id": session},
                      timeout=120) as response:
        request_id = response.headers["request-id"]
        deltas = 0
        for line in response.iter_lines():
            deltas += line.startswith("event: content_block_delta")
            if deltas >= 5:
                break
    status, stop_reason, _ = wait_finished(server, session)
    assert (status, stop_reason) == ("cancelled", "cancelled")
    deadline = time.monotonic() + 60
    while f"request {request_id}: cancelled after" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    n_output = int(server.log().split(f"request {request_id}: cancelled after ")[1].split()[0])
    assert 5 <= n_output < 2000
    assert query(server.db_path, "SELECT count(*) FROM messages WHERE agent_id = ?", session) == [(0,)]
    assert_engine_free(server)
