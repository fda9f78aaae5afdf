"""A local HTTP server that records what a real client sends and answers from a script.

Every POST is recorded (path, headers, JSON body) and answered by ``answer(path, body, n)``
(``n`` counts the requests from 1), which returns the payload and its content type; HEAD
gets an empty 200 (Claude Code probes ``HEAD /``). The stand-ins for the Anthropic API
(``claude_recorder``) and the Responses API (``codex_recorder``) are built on it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = Callable[[str, dict[str, Any], int], tuple[bytes, str]]


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class RecordingServer:
    def __init__(self, answer: Answer) -> None:
        self.requests: list[Recorded] = []
        recorder, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with lock:
                    recorder.requests.append(Recorded(self.path, dict(self.headers.items()), body))
                    n = len(recorder.requests)
                payload, kind = answer(self.path, body, n)
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
