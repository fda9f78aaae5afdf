"""No number of sockets ends the server, and no WebSocket client can take its memory (issue 59,
items 1-2), against a real ``semantic serve`` on SmolLM2 whose limits are raised to allow the
flood: real sockets, the real WebSocket handshake and the ``websockets`` client.

* 2,000 idle keep-alive TCP connections and 600 idle WebSockets: ``/health`` answers within
  1 s throughout, a WebSocket turn is still served, the process lives, and its resident memory
  comes back within 10% of before once the WebSockets close. (waitress on ``select()`` ended
  the process at the first descriptor past 1023.)
* Four WebSockets each sending 16 messages of 7 MiB while their first message is generated:
  the server reads ahead one frame per connection, not the library's 16, so its peak resident
  memory grows by far less than the 448 MiB the clients sent; after they close it is back
  within 10%.
"""
from __future__ import annotations

import base64
import json
import os
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from websockets.sync.client import connect

from support.servers import ServerProcess, start_server, stop_server

IDLE_SOCKETS = 2000
IDLE_WEBSOCKETS = 600
MESSAGE_BYTES = 7 << 20
MESSAGES = 16
DONE = ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    """A server whose limits allow the flood (and 8 MiB bodies), its idle timeout past the test,
    started with the usual soft limit of 1024 open files: it raises its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        server = start_server(tmp_path_factory.mktemp("roomy"), smollm2_dir, {
            "SEMANTIC_MAX_CONNECTIONS": str(IDLE_SOCKETS + 200), "SEMANTIC_MAX_WEBSOCKETS": str(IDLE_WEBSOCKETS + 50),
            "SEMANTIC_IDLE_TIMEOUT_S": "600", "SEMANTIC_MAX_BODY_BYTES": str(8 << 20), "SEMANTIC_THREADS": "8"})
    finally:  # the test's own sockets need as many
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, IDLE_SOCKETS + IDLE_WEBSOCKETS + 200)), hard))
    yield server
    stop_server(server)


def memory_kib(server: ServerProcess, field: str) -> int:
    """The server's ``VmRSS`` or ``VmHWM`` (peak) in KiB."""
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def settled_rss(server: ServerProcess, at_most_kib: float, wait_s: float = 15) -> int:
    """The server's resident memory once it is at most ``at_most_kib`` (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while (rss := memory_kib(server, "VmRSS")) > at_most_kib and time.monotonic() < deadline:
        time.sleep(0.5)
    return rss


def health_within(server: ServerProcess, limit_s: float = 1.0) -> float:
    started = time.monotonic()
    answer = httpx.get(f"{server.url}/health", timeout=limit_s)
    took = time.monotonic() - started
    assert answer.status_code == 200 and took < limit_s, (answer.status_code, took)
    return took


def read_head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"closed after {head!r}")
        head += chunk
    return head


def idle_keepalive(port: int) -> socket.socket:
    """A connection that has had one answer and stays open, sending nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def idle_websocket(port: int) -> socket.socket:
    """A socket upgraded to the Responses WebSocket (101 read), then silent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def ws_url(server: ServerProcess) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def one_turn(server: ServerProcess) -> dict:
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "Say hi.", "max_output_tokens": 4,
                            "temperature": 0, "store": False}))
        while (event := json.loads(ws.recv(timeout=120)))["type"] not in (*DONE, "error"):
            pass
    return event


def test_2000_idle_sockets_and_600_idle_websockets_leave_the_server_answering(roomy: ServerProcess) -> None:
    port = int(roomy.url.rsplit(":", 1)[1])
    one_turn(roomy)  # the model loaded and a WebSocket served once: what stays in memory is there
    before = memory_kib(roomy, "VmRSS")
    sockets = [idle_keepalive(port) for _ in range(IDLE_SOCKETS)]
    health_within(roomy)
    websockets = [idle_websocket(port) for _ in range(IDLE_WEBSOCKETS)]
    try:
        took = [health_within(roomy) for _ in range(5)]
        assert one_turn(roomy)["type"] in DONE
        assert roomy.process.poll() is None and max(took) < 1.0
        held = memory_kib(roomy, "VmRSS")
    finally:
        for sock in websockets:
            sock.close()
    after = settled_rss(roomy, before * 1.10)
    for sock in sockets:
        sock.close()
    health_within(roomy)
    assert roomy.process.poll() is None
    assert after <= before * 1.10, f"resident {before} KiB before, {held} with the WebSockets, {after} after"
    assert "filedescriptor out of range" not in roomy.log()


def test_websockets_flooding_large_messages_are_read_one_frame_ahead(roomy: ServerProcess) -> None:
    junk = json.dumps({"type": "response.cancel", "pad": "x" * MESSAGE_BYTES})
    turn = json.dumps({"type": "response.create", "model": "m", "input": "Count from one to fifty.",
                       "max_output_tokens": 64, "temperature": 0, "store": False})
    answers: list[list[str]] = []

    def client(messages: int) -> None:
        with connect(ws_url(roomy), max_size=None) as ws:
            ws.send(turn)  # generated while the junk arrives: the session reads no message meanwhile
            for _ in range(messages):
                ws.send(junk)
            kinds: list[str] = []
            while kinds.count("error") < messages or not set(DONE) & set(kinds):
                kinds.append(json.loads(ws.recv(timeout=300))["type"])
            answers.append(kinds)

    def four(messages: int) -> None:
        threads = [threading.Thread(target=client, args=(messages,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)

    four(1)  # the same four turns with one message each: what they leave in memory (a batch of four) is there
    before, peak_before = memory_kib(roomy, "VmRSS"), memory_kib(roomy, "VmHWM")
    four(MESSAGES)
    assert len(answers) == 8, answers
    grown_mib = (memory_kib(roomy, "VmHWM") - max(peak_before, before)) / 1024
    sent_mib = 4 * MESSAGES * MESSAGE_BYTES / 2**20
    after = settled_rss(roomy, before * 1.10)
    assert grown_mib < sent_mib / 2, f"the peak grew {grown_mib:.0f} MiB for {sent_mib:.0f} MiB sent"
    assert after <= before * 1.10, f"resident {before} KiB before, {after} after (peak +{grown_mib:.0f} MiB)"
