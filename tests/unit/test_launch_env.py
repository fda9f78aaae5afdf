"""What `semantic launch claude` gives Claude Code beside its server (issue 58, item 2): an hour
of patience for a slow model's long prefill (Claude Code 2.1.197 gives up on a request after
600 s, API_TIMEOUT_MS, and on a stream after 300 s without a byte, CLAUDE_STREAM_IDLE_TIMEOUT_MS).
The real CLI under launch: tests/e2e/test_claude_code.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.launch import plan


def test_launch_gives_claude_code_an_hour_for_a_request_and_a_stream(tmp_path: Path) -> None:
    launch = plan("claude", "http://127.0.0.1:8000", tmp_path, None, None, ["-p", "hi"], binary=sys.executable)
    assert launch.env["API_TIMEOUT_MS"] == launch.env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == "3600000"
    assert launch.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000" and launch.argv[1:] == ["-p", "hi"]
    assert "API_TIMEOUT_MS=3600000" in launch.shown()


def test_launch_sizes_claude_codes_reply_budget_to_the_served_context(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 62: Claude Code asks for 32,000 output tokens; on SmolLM2's 8K context a `-c` turn
    wrote until the context was full and the next request got 400s. launch passes a 16th of
    the served context (256 to 8,192), unless the caller set CLAUDE_CODE_MAX_OUTPUT_TOKENS."""
    monkeypatch.delenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", raising=False)
    small = plan("claude", "http://127.0.0.1:8000", tmp_path, None, None, [], sys.executable, context_length=8192)
    assert small.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
    big = plan("claude", "http://127.0.0.1:8000", tmp_path, None, None, [], sys.executable, context_length=262144)
    assert big.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in plan("claude", "u", tmp_path, None, None, [], sys.executable).env
    monkeypatch.setenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "300")  # the caller's own wins
    mine = plan("claude", "http://127.0.0.1:8000", tmp_path, None, None, [], sys.executable, context_length=8192)
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in mine.env
