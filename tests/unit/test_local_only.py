"""The cross-site guard's decisions, with plain values (no server)."""

from __future__ import annotations

import socket

import pytest

from app.api.local_only import LocalOnlyMiddleware, exposure_problem, host_name


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                         ("Example.COM", "example.com"), ("127.0.0.1", "127.0.0.1")])
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_loopback_bind_answers_only_to_loopback_names() -> None:
    guard = LocalOnlyMiddleware("127.0.0.1")
    assert all(guard.host_allowed(h) for h in ("localhost:8000", "127.0.0.1:1", "[::1]:8000", None))
    assert not guard.host_allowed("attacker.example:8000")
    assert not guard.host_allowed("127.0.0.1.nip.io")
    assert LocalOnlyMiddleware("127.0.0.1", allowed_hosts="box.lan").host_allowed("box.lan:8000")


def test_wildcard_bind_answers_to_the_network_but_not_to_a_rebound_name() -> None:
    """DNS rebinding points an attacker's public name at this machine: refused on a
    wildcard bind too; what a client on the network types is accepted."""
    guard = LocalOnlyMiddleware("0.0.0.0")
    for allowed in ("localhost:8000", "10.0.0.2:8000", "192.168.1.20", "172.16.5.5:1", "[fe80::1]:8000",
                    "[fd00::2]", "box.local:8000", "nas.internal", socket.gethostname() + ":8000", None):
        assert guard.host_allowed(allowed), allowed
    for refused in ("attacker.example", "attacker.example:8000", "8.8.8.8:8000", "127.0.0.1.nip.io", "local"):
        assert not guard.host_allowed(refused), refused
    listed = LocalOnlyMiddleware("0.0.0.0", allowed_hosts="chat.example.com")
    assert listed.host_allowed("chat.example.com:443") and not listed.host_allowed("other.example")
    assert LocalOnlyMiddleware("0.0.0.0", allowed_hosts="*").host_allowed("anything.example")
    assert not LocalOnlyMiddleware("127.0.0.1").host_allowed("10.0.0.2:8000")  # loopback binds stay strict


@pytest.mark.parametrize("host,key,insecure,refused", [
    ("127.0.0.1", "", False, False), ("localhost", "", False, False), ("::1", "", False, False),
    ("127.0.0.2", "", False, False), ("0.0.0.0", "", False, True), ("::", "", False, True),
    ("192.168.1.5", "", False, True), ("0.0.0.0", "k", False, False), ("0.0.0.0", "", True, False)])
def test_a_non_loopback_bind_needs_a_key_or_an_explicit_flag(host: str, key: str, insecure: bool,
                                                             refused: bool) -> None:
    problem = exposure_problem(host, key, insecure)
    assert (problem is not None) == refused
    if refused:
        assert "api_key" in problem and "--insecure-no-auth" in problem


def test_origins() -> None:
    guard = LocalOnlyMiddleware("127.0.0.1", allowed_origins="https://ui.example.com/")
    for allowed in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:9", "https://ui.example.com"):
        assert guard.origin_allowed(allowed), allowed
    for refused in ("https://evil.example", "null", "http://localhost.evil.example", "file://", "chrome-extension://x"):
        assert not guard.origin_allowed(refused), refused
    assert LocalOnlyMiddleware("127.0.0.1", allowed_origins="*").origin_allowed("https://evil.example")


def test_the_servers_own_origin_at_a_name_it_knows() -> None:
    """A page the server served (/agents) calls it back with its own origin: allowed at a
    name the server answers to by itself, on loopback and on the network; a foreign name
    even under allowed_hosts = * (a rebound name) and another port stay refused."""
    lan = LocalOnlyMiddleware("0.0.0.0")
    assert lan.origin_allowed("http://192.168.1.20:8000", "192.168.1.20:8000")
    assert lan.origin_allowed("http://box.local", "box.local")
    assert not lan.origin_allowed("http://192.168.1.20:8000", "192.168.1.20:9000")
    assert not lan.origin_allowed("http://192.168.1.20:8000", None)
    assert not lan.origin_allowed("http://attacker.example:8000", "attacker.example:8000")
    wildcard = LocalOnlyMiddleware("0.0.0.0", allowed_hosts="*")
    assert wildcard.host_allowed("attacker.example:8000")
    assert not wildcard.origin_allowed("http://attacker.example:8000", "attacker.example:8000")
    listed = LocalOnlyMiddleware("0.0.0.0", allowed_hosts="chat.example.com")
    assert listed.origin_allowed("https://chat.example.com", "chat.example.com")
