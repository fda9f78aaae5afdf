"""Optional API key and the body size limit, on a real server."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import pytest

from support.servers import ServerProcess, start_server, stop_server

KEY = "sk-local-test-key"
BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("locked"), smollm2_dir,
                          {"SEMANTIC_API_KEY": KEY, "SEMANTIC_MAX_BODY_BYTES": "4096",
                           "SEMANTIC_IDLE_TIMEOUT_S": "2", "SEMANTIC_THREADS": "2"})
    yield server
    stop_server(server)


def test_missing_or_wrong_key_gets_401_in_anthropic_shape(locked: ServerProcess) -> None:
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        response = httpx.post(f"{locked.url}/v1/messages", json=BODY, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=locked.url, api_key="wrong", max_retries=0).messages.create(**BODY)


def test_key_as_x_api_key_or_bearer(locked: ServerProcess) -> None:
    assert anthropic.Anthropic(base_url=locked.url, api_key=KEY).messages.create(**BODY).content
    bearer = httpx.post(f"{locked.url}/v1/messages", json=BODY, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200


def test_probes_stay_open(locked: ServerProcess) -> None:
    assert httpx.head(f"{locked.url}/").status_code == 200
    assert httpx.get(f"{locked.url}/health").status_code == 200


def test_oversized_body_gets_413(locked: ServerProcess) -> None:
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 10_000}]}
    response = httpx.post(f"{locked.url}/v1/messages", json=big, headers={"x-api-key": KEY})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


def _connect(server: ServerProcess, receive_buffer: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.settimeout(30)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connecting: it sets the window
    sock.connect((host, int(port)))
    return sock


def test_a_huge_announced_body_is_refused_before_it_is_read(locked: ServerProcess) -> None:
    """100 MiB announced, nothing sent: waitress answers 413 at once (its own limit is
    1 GiB: it would wait for the body and buffer it to a temporary file before the app,
    the key check or the app's 413 ran)."""
    with _connect(locked) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 104857600\r\n\r\n")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head


def test_an_idle_connection_is_closed(locked: ServerProcess) -> None:
    """Half a request line, then silence: closed after idle_timeout_s (2 s here; it
    used to be 600 s, so sockets that send nothing could hold every slot)."""
    with _connect(locked) as sock:
        sock.sendall(b"GET /health HT")
        assert sock.recv(4096) == b""  # closed by the server, well before the 30 s socket timeout


def test_clients_that_never_read_their_streams_hold_no_thread(locked: ServerProcess) -> None:
    """Both of the server's two threads given streams whose clients never read a byte: the
    answers are buffered (app/main.py: waitress's watermark above any answer), the threads are
    free for a third request, and the stalled sockets close after idle_timeout_s with the whole
    answer written. (On loopback the kernel's socket buffers, up to 4 MiB, would absorb these
    answers under waitress's default watermark too: what this guards is that nothing in the
    stream path waits for the client.)"""
    body = json.dumps({"model": "m", "max_tokens": 300, "temperature": 0, "stream": True,
                       "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}]}).encode()
    request = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"x-api-key: " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    stalled = [_connect(locked, receive_buffer=4096) for _ in range(2)]  # more than the kernels buffer
    for sock in stalled:
        sock.sendall(request)
    client = anthropic.Anthropic(base_url=locked.url, api_key=KEY, max_retries=0, timeout=120)
    assert client.messages.create(**BODY, extra_body={"temperature": 0}).content  # a thread was free for it
    for sock in stalled:
        with sock:
            received = b""
            while chunk := sock.recv(65536):  # until the server closes it
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"message_stop" in received
