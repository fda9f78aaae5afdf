"""Refuse what a web page could make a browser send: foreign origins, foreign hosts, non-JSON bodies.

A page on any site can make the user's browser POST to ``127.0.0.1:8000``: a
``text/plain`` POST needs no CORS preflight, and DNS rebinding points a foreign
name at loopback so even reads look same-origin. So, like other local model
servers, every request is checked before routing:

- ``Origin`` (browsers send it on cross-site requests): allowed if it is a
  loopback origin (``localhost``, ``127.0.0.1``, ``[::1]``, any port), listed
  in ``allowed_origins``, or the request's own ``Host`` at a name the server
  knows (its own pages, such as ``/agents``, served on the network); else 403.
  Clients that are not browsers send none.
- ``Host``: when the server listens on loopback, it must name loopback (or an
  entry of ``allowed_hosts``); a rebound name gets 403. A server bound to another
  address (``0.0.0.0``, a LAN address) also answers to its bind address, the
  machine's own names and addresses, private and link-local IP addresses, and
  names under ``.local`` / ``.internal``: what a client on the network types,
  never an attacker's public name rebound to this machine. Such a server must
  have an ``api_key`` (``exposure_problem``).
- A request body must be ``application/json`` (415 otherwise): the content
  types a page may send without a preflight are all refused. One exception: ``GET /``'s
  key form posts ``application/x-www-form-urlencoded`` to ``/session``, with the
  ``Origin`` header every browser sends on a POST, which must then be allowed.

Allowed origins get CORS headers, so a local web UI can call the API.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import falcon

from app.api.page_key import KEY_FORM_PATH
from app.errors import Forbidden, UnsupportedMediaType

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
LAN_SUFFIXES = (".local", ".internal")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def split_list(value: str) -> frozenset[str]:
    """A comma-separated setting as a set of lower-case entries."""
    return frozenset(item.strip().lower().rstrip("/") for item in value.split(",") if item.strip())


def host_name(host_header: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``Example.com:80`` -> ``example.com``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(bind_host: str) -> bool:
    """Whether a bind address reaches this machine only (``localhost``, ``127.x``, ``::1``)."""
    bind = bind_host.strip().lower().strip("[]")
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def exposure_problem(bind_host: str, api_key: str, insecure_no_auth: bool) -> str | None:
    """Why serving ``bind_host`` as configured is refused (None: it is not)."""
    if is_loopback(bind_host) or api_key or insecure_no_auth:
        return None
    return (f"host {bind_host!r} is reachable from other machines and api_key is not set: anyone on the "
            "network could read and change every agent's history. Set api_key (SEMANTIC_API_KEY), bind "
            "127.0.0.1, or pass --insecure-no-auth (SEMANTIC_INSECURE_NO_AUTH=1) to serve it open anyway")


def machine_hosts() -> frozenset[str]:
    """This machine's own names and addresses, as a client on the network would type them."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    addresses: set[str] = set()
    for name in names:
        try:
            addresses |= {str(info[4][0]).lower() for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return frozenset(names | addresses)


def is_lan_name(host: str) -> bool:
    """A private or link-local IP address, or a name under .local / .internal."""
    if host.endswith(LAN_SUFFIXES):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_private or address.is_link_local


class LocalOnlyMiddleware:
    def __init__(self, bind_host: str, allowed_origins: str = "", allowed_hosts: str = "") -> None:
        self._origins = split_list(allowed_origins)
        self._hosts = split_list(allowed_hosts)
        bind = bind_host.strip().lower().strip("[]")
        self._lan = not is_loopback(bind)
        self._known_hosts = LOOPBACK_HOSTS | {bind} | self._hosts | (machine_hosts() if self._lan else frozenset())

    def origin_allowed(self, origin: str, host_header: str | None = None) -> bool:
        """A loopback or listed origin, or the server's own (a page it served, such as /agents,
        calling it back) at a name it knows without ``allowed_hosts = *``."""
        origin = origin.strip().lower().rstrip("/")
        if "*" in self._origins or origin in self._origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https"):
            return False
        if (parts.hostname or "") in LOOPBACK_HOSTS:
            return True
        if host_header is None or parts.netloc != host_header.strip().lower():
            return False
        return self._known(host_name(host_header))

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header or "*" in self._hosts:
            return True
        return self._known(host_name(host_header))

    def _known(self, host: str) -> bool:
        return host in self._known_hosts or (self._lan and is_lan_name(host))

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.host_allowed(req.get_header("HOST")):
            raise Forbidden(f"host {req.get_header('HOST')!r} is not allowed: this server answers to "
                            "localhost (add the name to allowed_hosts to serve it)")
        origin = req.get_header("ORIGIN")
        if origin is not None:
            if not self.origin_allowed(origin, req.get_header("HOST")):
                raise Forbidden(f"origin {origin!r} is not allowed (add it to allowed_origins to let a web page "
                                "call this server)")
            resp.set_header("Access-Control-Allow-Origin", origin)
            resp.set_header("Vary", "Origin")
            if req.method == "OPTIONS":  # a CORS preflight from an allowed page
                resp.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
                resp.set_header("Access-Control-Allow-Headers",
                                req.get_header("ACCESS-CONTROL-REQUEST-HEADERS") or "content-type")
                resp.status = falcon.HTTP_204
                resp.complete = True
                return
        if req.method in BODY_METHODS and (req.content_length or 0) > 0:
            media_type = (req.content_type or "").split(";", 1)[0].strip().lower()
            key_form = req.path == KEY_FORM_PATH and origin is not None and \
                media_type == "application/x-www-form-urlencoded"
            if media_type != "application/json" and not key_form:
                raise UnsupportedMediaType(f"content-type: request bodies must be application/json, "
                                           f"got {req.content_type or 'none'!r}")
