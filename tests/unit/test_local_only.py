"""The cross-site guard's decisions, with plain values (no server)."""

from __future__ import annotations

import pytest

from app.api.local_only import LocalOnlyMiddleware, host_name


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


def test_wildcard_bind_checks_hosts_only_when_listed() -> None:
    assert LocalOnlyMiddleware("0.0.0.0").host_allowed("anything.example")
    guard = LocalOnlyMiddleware("0.0.0.0", allowed_hosts="box.lan, 10.0.0.2")
    assert guard.host_allowed("10.0.0.2:8000") and not guard.host_allowed("other.example")


def test_origins() -> None:
    guard = LocalOnlyMiddleware("127.0.0.1", allowed_origins="https://ui.example.com/")
    for allowed in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:9", "https://ui.example.com"):
        assert guard.origin_allowed(allowed), allowed
    for refused in ("https://evil.example", "null", "http://localhost.evil.example", "file://", "chrome-extension://x"):
        assert not guard.origin_allowed(refused), refused
    assert LocalOnlyMiddleware("127.0.0.1", allowed_origins="*").origin_allowed("https://evil.example")
