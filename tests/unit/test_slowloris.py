"""Clients that hold sockets without sending a request cannot lock probes out (issue 35, item 12).

A real waitress server on loopback, built as ``app.main`` builds it (``make_server`` with
``waitress_options``), under a bounded attack: more half-open sockets than ``max_connections``,
each dripping a header byte now and then. ``/health`` must still answer within 1 s.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest

from app.http_server import make_server
from app.main import waitress_options
from app.settings import Settings

ATTACKERS = 150


def _health_app(environ, start_response):  # type: ignore[no-untyped-def]
    start_response("200 OK", [("Content-Type", "application/json")])
    return [b'{"status": "ok"}']


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[object, int]]:  # type: ignore[no-untyped-def]
    settings = Settings.model_construct(home=tmp_path, port=0, threads=2)  # port 0 (any free one) is below the bounds
    server = make_server(_health_app, **waitress_options(settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield server, server.effective_port
    server.close()
    thread.join(5)


def _attack(port: int, stop: threading.Event) -> list[socket.socket]:
    """ATTACKERS sockets each sending the start of a request head, then one byte every 0.5 s."""
    socks = []
    for _ in range(ATTACKERS):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nX-a: ")
        socks.append(s)

    def drip() -> None:
        while not stop.wait(0.5):
            for s in socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    threading.Thread(target=drip, daemon=True).start()
    return socks


def _health(port: int, timeout: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return s.recv(1024)


def test_health_answers_within_a_second_beside_150_dripping_half_open_sockets(served) -> None:  # type: ignore[no-untyped-def]
    _, port = served
    stop = threading.Event()
    socks = _attack(port, stop)
    try:
        time.sleep(1.5)  # the drip has begun; every socket is accepted or queued
        started = time.monotonic()
        answer = _health(port, timeout=1.0)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_a_head_that_drips_past_the_deadline_is_closed(served, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    server, port = served
    monkeypatch.setattr(server, "head_timeout_s", 1)
    server.adj.cleanup_interval = 1
    server.next_channel_cleanup = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        closed_after = None
        started = time.monotonic()
        while time.monotonic() - started < 6:
            try:
                s.send(b"X-a: b\r\n")
            except OSError:
                closed_after = time.monotonic() - started
                break
            s.settimeout(0.3)
            try:
                if s.recv(1) == b"":
                    closed_after = time.monotonic() - started
                    break
            except socket.timeout:
                pass
        assert closed_after is not None and closed_after < 4, "a dripping head kept its socket"
