"""GET /agents: the page for people. The agents, their conversations and caches, and a place
to talk to them (create an agent, stream a turn, stop it, start a conversation, delete), in
three static files (HTML, script, style) that hold no data: the script reads and writes the
agent API from the browser, with the key the user enters when one is set.
So the files are served without the key (``middleware.OPEN_PATHS``), and under a content
security policy that allows no inline script, no other origin and no framing."""

from __future__ import annotations

from pathlib import Path

import falcon

STATIC = Path(__file__).parent / "static"
# path -> (file under static/, content type)
FILES = {"/agents": ("people.html", "text/html; charset=utf-8"),
         "/agents/page.js": ("people.js", "text/javascript; charset=utf-8"),
         "/agents/page.css": ("people.css", "text/css; charset=utf-8")}
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class PageFileResource:
    def __init__(self, name: str, content_type: str) -> None:
        self._data = (STATIC / name).read_bytes()
        self._content_type = content_type

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = self._content_type
        resp.data = self._data
        resp.set_header("Content-Security-Policy", POLICY)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Referrer-Policy", "no-referrer")
        resp.set_header("Cache-Control", "no-cache")
