"""The waitress server, hardened against clients that hold sockets without sending a request.

waitress closes a socket only after ``channel_timeout`` seconds *without a byte*, so a client
that drips one header byte every few seconds (slowloris) holds its socket, and a few hundred
such sockets (or idle half-open ones) fill ``connection_limit``: waitress then stops accepting
and ``/health`` goes unanswered. Two rules hold here:

* a request head (request line and headers) must arrive within ``HEAD_TIMEOUT_S`` of its first
  byte (of the accept, for a new socket), however slowly it drips;
* at the connection limit, the socket that has owed its head the longest is closed to make room,
  so new connections (a probe, a client) are still accepted.

A socket with a request in progress or an answer being written is never closed by either rule.

A request's WSGI environ says when its first byte was read (``ARRIVED``): its time to first
token starts there, so the client's upload of its body and its wait for a free worker thread
(while every one serves a stream) count in it, as the client counts them.

A request may also take its socket over (``TAKE_SOCKET`` in its WSGI environ: the Responses
API's WebSocket upgrade, ``app/api/responses_socket.py``): waitress then forgets the socket
(it no longer reads, writes, times out or counts it) and drops what the request's answer
would have written; whoever took it closes it, and counts it against its own limit.

No number of sockets stops the loop: it waits on ``poll()`` (``select()``, waitress's default,
cannot watch a descriptor at or above 1024 and raised out of the loop, ending the process), the
process may open the descriptors the limits allow (``open_files_needed``, raised at start by
``allow_open_files``), and an ``accept()`` that finds none left pauses accepting for a moment
instead of spinning on the listening socket.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import WSGITask

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10  # a request line and headers sent a byte at a time by a live client take far less
TAKE_SOCKET = "semantic.take_socket"  # the WSGI environ key of a request's HeadDeadlineChannel.take_socket
ARRIVED = "semantic.arrived"  # the WSGI environ key of when a request's first byte was read (time.perf_counter())
ACCEPT_PAUSE_S = 0.5  # how long accepting waits after accept() found no descriptor left


class TimedRequestParser(HTTPRequestParser):
    """A request as it is read, and when its first byte was (``arrived``): waitress makes one
    as a request's first bytes come in."""

    def __init__(self, adj) -> None:  # type: ignore[no-untyped-def]
        super().__init__(adj)
        self.arrived = time.perf_counter()


class SocketTakingTask(WSGITask):
    """A WSGI task whose environ can take the connection's socket over (``TAKE_SOCKET``) and
    says when the request's first byte was read (``ARRIVED``)."""

    def get_environment(self) -> dict:
        environ = super().get_environment()  # cached by waitress: this adds the keys once
        environ[TAKE_SOCKET] = self.channel.take_socket
        environ[ARRIVED] = getattr(self.request, "arrived", None)
        return environ


class HeadDeadlineChannel(HTTPChannel):
    """A channel that knows since when it has owed a request head (None: it owes none), and
    whose socket a request may take over."""

    task_class = SocketTakingTask
    parser_class = TimedRequestParser

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_since: float | None = self.creation_time
        self.taken = False

    def take_socket(self, timeout_s: float = 10) -> socket.socket:
        """This connection's socket, blocking, for the caller alone from now on: waitress's
        loop no longer sees it and the taking request's answer is dropped. The caller owns
        it and closes it.

        Raises:
            OSError: the server's loop did not let it go within ``timeout_s`` (stopping).
        """
        released = threading.Event()

        def release() -> None:
            self.taken = True
            self.del_channel()
            released.set()

        # NOTE: the loop's thread lets it go: it alone changes the channel map and
        # active_channels, which its maintenance iterates.
        self.server.trigger.pull_trigger(release)
        if not released.wait(timeout_s):
            raise OSError("the server did not hand the socket over")
        self.socket.setblocking(True)
        return self.socket

    def write_soon(self, data: bytes) -> int:
        if self.taken:  # the socket speaks another protocol now
            return len(data)
        return super().write_soon(data)

    def received(self, data: bytes) -> bool:
        if self.request is None and self.head_since is None and not self.requests:
            self.head_since = time.time()  # the first byte of a next request on a kept-alive socket
        result = super().received(data)
        if self.request is None or self.request.headers_finished:
            self.head_since = None
        return result

    def owes_head(self) -> bool:
        """True while no request has its head complete and nothing is being answered."""
        return self.head_since is not None and not self.requests and not self.total_outbufs_len


class GuardedServer(TcpWSGIServer):
    """A TCP server whose maintenance enforces the head deadline and sheds stalled sockets at its limit."""

    channel_class = HeadDeadlineChannel
    head_timeout_s: float = HEAD_TIMEOUT_S
    accept_paused_until = 0.0

    def accept(self):  # type: ignore[no-untyped-def]  # waitress's: (socket, address) or None
        try:
            return super().accept()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            # NOTE: the connection waits in the listen backlog; accepting again at once would
            # spin on the listener, readable for as long as no descriptor is freed.
            self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
            log.warning("no file descriptor left to accept a connection (%s): accepting again in %.1f s",
                        exc.strerror, ACCEPT_PAUSE_S)
            return None

    def maintenance(self, now: float) -> None:
        super().maintenance(now)
        cutoff = now - self.head_timeout_s
        late = [c for c in self._stalled() if (c.head_since or now) < cutoff]
        for channel in late:
            channel.will_close = True
        if late:
            log.info("closed %d connection(s) that sent no complete request head within %d s",
                     len(late), self.head_timeout_s)

    def readable(self) -> bool:
        if self.accept_paused_until and time.monotonic() < self.accept_paused_until:
            return False
        if self.accepting and len(self._map) >= self.adj.connection_limit and self._shed_one():
            return False  # the shed socket closes in this poll; the next accepts again
        return super().readable()

    def _stalled(self) -> list[HeadDeadlineChannel]:
        return [c for c in self.active_channels.values()
                if isinstance(c, HeadDeadlineChannel) and not c.will_close and c.owes_head()]

    def _shed_one(self) -> bool:
        """Close the socket that has owed its head the longest (True), so that accepting goes on."""
        stalled = self._stalled()
        if not stalled:
            return False
        oldest = min(stalled, key=lambda c: c.head_since or time.time())
        oldest.will_close = True
        log.debug("at the connection limit (%d): closing a connection that owes its request head since %.1f s",
                  self.adj.connection_limit, time.time() - (oldest.head_since or time.time()))
        return True


def make_server(app, **options) -> GuardedServer:
    """A ``GuardedServer`` for ``app`` on one TCP address, with waitress's ``options``."""
    return GuardedServer(app, **options)
