"""What a Responses WebSocket may hold (issue 59, item 2): the app on a fake engine behind the real
waitress server, as ``app.main`` builds it, on loopback, with the real ``websockets`` client.

At most ``max_websockets`` are open: one more upgrade is refused with 429 in the Responses shape,
and a closed one frees its place. One that sends nothing for ``idle_timeout_s`` is closed by the
server with a normal closure. (Before, connections were unlimited and outlived the idle timeout.)
The floods themselves, against a real server: tests/e2e/test_socket_floods.py.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import connect

from app.agents.service import AgentService
from app.api.routes import Deps
from app.http_server import make_server
from app.main import create_app, waitress_options
from app.settings import Settings
from app.store.db import make_engine, make_session_factory, upgrade
from support.fake_engine import FakeEngine


@pytest.fixture
def ws_url(tmp_path: Path) -> Iterator[str]:
    """A WebSocket URL of a real server allowing two WebSockets, idle after 1 s."""
    db = f"sqlite:///{tmp_path / 'semantic.db'}"
    upgrade(db)
    sessions = make_session_factory(make_engine(db))
    settings = Settings(home=tmp_path, max_websockets=2, idle_timeout_s=1)
    app = create_app(Deps(settings, FakeEngine(tmp_path), AgentService(sessions), sessions))
    server = make_server(app, **{**waitress_options(settings), "port": 0})
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield f"ws://127.0.0.1:{server.effective_port}/v1/responses"
    server.close()
    thread.join(5)


def test_an_upgrade_beyond_max_websockets_is_a_429_and_a_closed_one_frees_its_place(ws_url: str) -> None:
    with connect(ws_url) as first, connect(ws_url):
        with pytest.raises(InvalidStatus) as refused:
            with connect(ws_url):
                pass
        answer = refused.value.response
        assert answer.status_code == 429 and answer.headers["retry-after"] == "5"
        error = json.loads(answer.body)["error"]
        assert "max_websockets" in error["message"] and error["type"], error
        first.close()
        deadline = time.monotonic() + 5
        while True:  # the server's session notices the close on its own thread
            try:
                with connect(ws_url) as third:
                    third.send(json.dumps({"type": "response.create", "model": "m", "input": "hi",
                                           "max_output_tokens": 4}))
                    assert json.loads(third.recv(timeout=10))["type"] == "response.created"
                break
            except InvalidStatus:
                assert time.monotonic() - deadline < 0, "a closed WebSocket kept its place"
                time.sleep(0.05)


def test_a_websocket_that_sends_nothing_for_idle_timeout_s_is_closed(ws_url: str) -> None:
    with connect(ws_url) as ws:
        started = time.monotonic()
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(timeout=10)
        assert time.monotonic() - started < 5
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
