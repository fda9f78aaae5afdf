"""When `semantic serve` starts itself again with huge pages, and what its start log says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app import huge_pages
from app.huge_pages import describe, thp_mode, tunables_to_start_with

GLIBC = ("glibc", "2.36")


def test_huge_pages_are_asked_for_where_the_kernel_gives_them_on_request() -> None:
    assert tunables_to_start_with({}, "madvise", GLIBC) == "glibc.malloc.hugetlb=1"
    # The operator's other tunables are kept.
    assert tunables_to_start_with({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC) == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert tunables_to_start_with({}, "madvise", ("glibc", "2.35")) == "glibc.malloc.hugetlb=1"


def test_the_process_goes_on_as_it_is_where_a_restart_would_change_nothing() -> None:
    assert tunables_to_start_with({}, "always", GLIBC) is None  # every process has them
    assert tunables_to_start_with({}, "never", GLIBC) is None  # none can
    assert tunables_to_start_with({}, None, GLIBC) is None  # no transparent huge pages at all
    assert tunables_to_start_with({}, "madvise", ("glibc", "2.34")) is None  # no such tunable
    assert tunables_to_start_with({}, "madvise", ("", "")) is None  # musl, or another C library
    # The operator's own choice, either way; and the restarted process itself does not restart.
    assert tunables_to_start_with({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC) is None
    assert tunables_to_start_with({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", GLIBC) is None


def test_the_kernels_mode_is_the_bracketed_one(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert thp_mode(enabled) == "madvise"
    enabled.write_text("[always] madvise never\n")
    assert thp_mode(enabled) == "always"
    assert thp_mode(tmp_path / "missing") is None


def test_the_start_log_says_whether_and_why() -> None:
    assert describe({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise") == \
        "huge pages on (GLIBC_TUNABLES glibc.malloc.hugetlb=1)"
    assert describe({"GLIBC_TUNABLES": "a=1:glibc.malloc.hugetlb=0"}, "madvise") == \
        "huge pages off (GLIBC_TUNABLES glibc.malloc.hugetlb=0)"
    assert describe({}, "madvise") == \
        "huge pages off (GLIBC_TUNABLES does not set glibc.malloc.hugetlb, which glibc 2.35 or later has)"
    assert describe({}, "always") == "huge pages on (the kernel's transparent_hugepage is 'always')"
    assert describe({}, "never") == "huge pages off (the kernel's transparent_hugepage is 'never')"


def test_the_new_start_is_this_command_line_with_the_tunable_and_a_failed_one_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The call itself (the e2e test has a real `semantic serve` start again)."""
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: GLIBC)
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    calls = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env["GLIBC_TUNABLES"]))
        raise OSError("the interpreter's file is gone")

    monkeypatch.setattr(huge_pages.os, "execve", execve)
    huge_pages.start_with_huge_pages()  # returns: the process goes on as it is
    assert calls == [(sys.executable, sys.orig_argv, "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")]
