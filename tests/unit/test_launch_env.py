"""What `semantic launch claude` gives Claude Code beside its server (issue 58, item 2): an hour
of patience for a slow model's long prefill (Claude Code 2.1.197 gives up on a request after
600 s, API_TIMEOUT_MS, and on a stream after 300 s without a byte, CLAUDE_STREAM_IDLE_TIMEOUT_MS).
The real CLI under launch: tests/e2e/test_claude_code.py."""
from __future__ import annotations

import sys
from pathlib import Path

from app.launch import plan


def test_launch_gives_claude_code_an_hour_for_a_request_and_a_stream(tmp_path: Path) -> None:
    launch = plan("claude", "http://127.0.0.1:8000", tmp_path, None, None, ["-p", "hi"], binary=sys.executable)
    assert launch.env["API_TIMEOUT_MS"] == launch.env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == "3600000"
    assert launch.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000" and launch.argv[1:] == ["-p", "hi"]
    assert "API_TIMEOUT_MS=3600000" in launch.shown()
