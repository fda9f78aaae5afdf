"""The pool's router: HAProxy, configured to send each agent to the server that holds it.

HAProxy passes every header and the body through untouched (SMG drops the session
headers and rewrites model names; docs/pool.md). The routing key is the agent's
identity as the servers read it: Claude Code's session header, Codex's ``session-id``,
the direct API's agent id in the path, else ``metadata.user_id`` or ``session_id`` in a
JSON body small enough to be buffered; a Responses API request with ``previous_response_id``
goes where that response was made (each server names its reply in a header). An agent's first request goes to the server
with the fewest open requests, and a stick table keeps it there (a bounded-load
consistent hash, tried first, moved 15% of turns away from their cache with 8 agents
arriving together: benchmarks/pool.py). A server that fails its health check (every
0.5 s), or refuses a request's connection, is out at once, that request is retried on
another, and the agent stays on its new server (no flap-back when the old one returns).
A request with no agent key has no entry in the table: it goes to the least busy server.

Servers join and leave a running router through HAProxy's runtime API (``RuntimeAPI``):
a joining server takes new agents only, no agent already placed moves; a server put in
maintenance (drained) is skipped, and its agents' entries move to where they land next.
The runtime API is a unix socket on the router's machine (``pool up``), or a TCP address
(``ADDR:PORT``) for a pool over several machines, where servers join from their own host.
HAProxy asks nothing of who connects to it: whoever reaches that address commands the
router (adds a server of theirs, takes servers out), so it is bound to the router host's
private address and is a trust boundary (docs/pool.md).
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass

from app.errors import ConfigError

# What a request's agent is, in the order the servers themselves look (app/agents/identity.py).
KEY_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id")
# The id of the reply a server made (app/api/generation.py): the router remembers where each
# Responses API response was made, so a request continuing it with ``previous_response_id``
# goes to the same server.
REPLY_ID_HEADER = "x-semantic-reply-id"


@dataclass(frozen=True, slots=True)
class Backend:
    server_id: str
    host: str
    port: int


def haproxy_binary() -> str:
    found = shutil.which("haproxy")
    if found is None:
        raise ConfigError("HAProxy is not installed (the pool's router): apt-get install haproxy")
    return found


ROUTINGS = ("affinity", "round-robin")
# Every server's health check and fault handling, also for servers added at run time
# (they do not take the configuration's ``default-server`` line).
SERVER_OPTIONS = "check inter 500ms fall 1 rise 2 observe layer4 error-limit 1 on-error mark-down"


def tcp_address(admin: str) -> tuple[str, int] | None:
    """``(host, port)`` of a runtime API given as ``HOST:PORT``; None for a unix socket's path."""
    host, colon, port = admin.rpartition(":")
    if admin.startswith("/") or not colon or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def stats_socket(admin: str) -> str:
    """The ``stats socket`` line of the runtime API: a unix socket only its owner opens, or a TCP
    address (``HOST:PORT``; no authentication: whoever reaches it commands the router)."""
    address = tcp_address(admin)
    if address is None:
        return f'stats socket "{admin}" mode 600 level admin'
    family = "ipv6" if ":" in address[0] else "ipv4"
    return f"stats socket {family}@{address[0]}:{address[1]} level admin"


def render_config(port: int, backends: list[Backend], admin_socket: str, host: str = "127.0.0.1",
                  routing: str = "affinity") -> str:
    """HAProxy's configuration for a pool listening on ``host:port``, its runtime API on
    ``admin_socket`` (a path, or ``HOST:PORT`` over TCP). ``routing`` "round-robin" ignores
    the agent (what a generic load balancer does: the baseline of benchmarks/pool.py)."""
    keys = ["    http-request set-var(txn.key) req.body,json_query('$.session_id') if { req.body_size lt 16000 }",
            "    http-request set-var(txn.key) req.body,json_query('$.metadata.user_id') if { req.body_size lt 16000 }",
            "    http-request set-var(txn.key) path,field(4,/) if { path_beg /v1/agents/ }"]
    keys += [f"    http-request set-var(txn.key) req.hdr({name}) if {{ req.hdr({name}) -m found }}"
             for name in reversed(KEY_HEADERS)]  # the last one set wins: the first header present
    # A Responses request continuing a stored response belongs to that response's agent,
    # whatever its headers say (app/api/responses.py): it goes where that response was made.
    keys += ["    http-request set-var(txn.key) req.body,json_query('$.previous_response_id') "
             "if { req.body_size lt 16000 }"]
    servers = "\n".join(f"    server {b.server_id} {b.host}:{b.port}" for b in backends)
    sticky = ("    balance roundrobin" if routing == "round-robin" else
              "    balance leastconn\n    stick-table type string len 300 size 1m expire 7d\n"
              "    stick on var(txn.key)\n"
              f"    stick store-response res.hdr({REPLY_ID_HEADER}) if {{ res.hdr({REPLY_ID_HEADER}) -m beg resp_ }}")
    return f"""# Written by `semantic pool up`; rewritten at each start.
global
    {stats_socket(admin_socket)}
    tune.bufsize 32768
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    # Stream tokens as they come: without it HAProxy holds back a small write for more
    # (MSG_MORE), and an answer's first event reaches the client late by that wait.
    option http-no-delay
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout http-request 30s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
    default-server {SERVER_OPTIONS}
frontend pool
    bind {host}:{port}
    option http-buffer-request
{chr(10).join(keys)}
    default_backend servers
backend servers
{sticky}
    option httpchk GET /health
{servers}
"""



class RuntimeAPI:
    """HAProxy's runtime API on its admin socket (a path, or ``HOST:PORT`` over TCP): servers
    join and leave a running router."""

    def __init__(self, admin_socket: str, backend: str = "servers") -> None:
        self._path = admin_socket
        self._backend = backend

    def command(self, line: str) -> str:
        """Run one command; returns HAProxy's answer.

        Raises:
            ConfigError: the router cannot be reached, or it refused the command.
        """
        try:
            address = tcp_address(self._path)
            family = socket.AF_UNIX if address is None else socket.AF_INET6 if ":" in address[0] else socket.AF_INET
            with socket.socket(family) as connection:
                connection.settimeout(10)
                connection.connect(self._path if address is None else address)
                connection.sendall(line.encode() + b"\n")
                answer = b"".join(iter(lambda: connection.recv(65536), b"")).decode(errors="replace").strip()
        except OSError as exc:
            raise ConfigError(f"the router's runtime API ({self._path}): {exc}") from exc
        if answer and not answer.startswith(("New server registered", "#")) and "\n" not in answer:
            raise ConfigError(f"the router refused {line.split()[0:3]}: {answer}")
        return answer

    def add_server(self, backend: Backend) -> None:
        """A new server, health-checked and ready (it takes new agents; placed ones stay)."""
        name = f"{self._backend}/{backend.server_id}"
        self.command(f"add server {name} {backend.host}:{backend.port} {SERVER_OPTIONS}")
        self.command(f"enable health {name}")
        self.command(f"set server {name} state ready")

    def set_state(self, server_id: str, state: str) -> None:
        """``ready``, ``drain`` or ``maint`` (a server in maintenance gets no request)."""
        self.command(f"set server {self._backend}/{server_id} state {state}")
