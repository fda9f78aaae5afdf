"""The pool's router: HAProxy, configured to send each agent to the server that holds it.

HAProxy passes every header and the body through untouched (SMG drops the session
headers and rewrites model names; docs/pool.md). The routing key is the agent's
identity as the servers read it: Claude Code's session header, Codex's ``session-id``,
the direct API's agent id in the path, else ``metadata.user_id`` or ``session_id`` in a
JSON body small enough to be buffered. An agent's first request goes to the server
with the fewest open requests, and a stick table keeps it there (a bounded-load
consistent hash, tried first, moved 15% of turns away from their cache with 8 agents
arriving together: benchmarks/pool.py). A server that fails its health check (every
0.5 s), or refuses a request's connection, is out at once, that request is retried on
another, and the agent stays on its new server (no flap-back when the old one returns).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from app.errors import ConfigError

# What a request's agent is, in the order the servers themselves look (app/agents/identity.py).
KEY_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id")


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


def render_config(port: int, backends: list[Backend], admin_socket: str, host: str = "127.0.0.1",
                  routing: str = "affinity") -> str:
    """HAProxy's configuration for a pool listening on ``host:port``. ``routing``
    "round-robin" ignores the agent (what a generic load balancer does: the baseline
    of benchmarks/pool.py)."""
    keys = ["    http-request set-var(txn.key) req.body,json_query('$.session_id') if { req.body_size lt 16000 }",
            "    http-request set-var(txn.key) req.body,json_query('$.metadata.user_id') if { req.body_size lt 16000 }",
            "    http-request set-var(txn.key) path,field(4,/) if { path_beg /v1/agents/ }"]
    keys += [f"    http-request set-var(txn.key) req.hdr({name}) if {{ req.hdr({name}) -m found }}"
             for name in reversed(KEY_HEADERS)]  # the last one set wins: the first header present
    keyed = "" if routing == "round-robin" else "    use_backend keyed if { var(txn.key) -m found }"
    servers = "\n".join(f"    server {b.server_id} {b.host}:{b.port}" for b in backends)
    tracked = "\n".join(f"    server {b.server_id} {b.host}:{b.port} no-check track keyed/{b.server_id}"
                        for b in backends)
    return f"""# Written by `semantic pool up`; rewritten at each start.
global
    stats socket "{admin_socket}" mode 600 level admin
    tune.bufsize 32768
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout http-request 30s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
    default-server inter 500ms fall 1 rise 2 check observe layer4 error-limit 1 on-error mark-down
frontend pool
    bind {host}:{port}
    option http-buffer-request
{chr(10).join(keys)}
{keyed}
    default_backend unkeyed
backend keyed
    balance leastconn
    stick-table type string len 300 size 1m expire 7d
    stick on var(txn.key)
    option httpchk GET /health
{servers}
backend unkeyed
    balance {"roundrobin" if routing == "round-robin" else "leastconn"}
{tracked}
"""
