"""Server-sent events over WSGI: an iterable of byte frames that cancels on close."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from typing import Any

from app.errors import SemanticError
from app.protocol.reply import Reply
from app.types import Heartbeat


def frame(event: str | None, data: Any) -> bytes:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def keep_alive(heartbeat: Heartbeat) -> bytes:
    """The SSE comment a heartbeat sends (clients ignore comments, proxies see traffic): the
    prefill's progress when there is one (``: prefill 1024/4249 prompt tokens``)."""
    if heartbeat.n_prompt:
        return f": prefill {heartbeat.n_ready}/{heartbeat.n_prompt} prompt tokens\n\n".encode()
    return b": keep-alive\n\n"


# A dialect's stream: its bytes, and the Reply it sent once generation finished (before its closing bytes).
Frames = Generator[bytes | Reply, None, None]


def framed(items: Generator[Any, None, None], render: Callable[[Any], bytes]) -> Frames:
    """``items`` as ``render`` writes each, a ``Reply`` passed as it is. An error thrown in (the
    reply's recording failed) goes on to ``items``, which may end the stream its own way."""
    end = object()
    item = next(items, end)
    while item is not end:
        try:
            yield item if isinstance(item, Reply) else render(item)
        except SemanticError as exc:
            item = items.throw(exc)
            continue
        item = next(items, end)


class SseStream:
    """A WSGI response body. ``close()`` (called by the server when the client
    goes away or the response ends) runs ``on_close``, which cancels generation
    even if iteration never started."""

    def __init__(self, frames: Iterator[bytes], on_close: Callable[[], None]) -> None:
        self._frames = frames
        self._on_close = on_close

    def __iter__(self) -> Iterator[bytes]:
        return self._frames

    def close(self) -> None:
        try:
            close = getattr(self._frames, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()
