"""A scripted stand-in for the Anthropic API that records what the real Claude Code CLI sends.

The CLI is driven headless against it: each request is recorded (headers and JSON body)
and answered from a small script, so a session takes the paths a real one takes (a tool
call the CLI runs, a subagent it starts, the results it sends back) in seconds. The
recorded requests are then replayed against a real Semantic server in the order, and the
races, the real CLI produces.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Callable

from support.recording import Answer, Recorded, RecordingServer

SUBAGENT_MARKER = "You are an agent for Claude Code"


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") if b.get("type") == "text" else json.dumps(b) for b in content)


def system_text(body: dict[str, Any]) -> str:
    return text_of(body.get("system") or [])


def is_subagent(body: dict[str, Any]) -> bool:
    return SUBAGENT_MARKER in system_text(body)


def last_has_tool_result(body: dict[str, Any]) -> bool:
    content = body["messages"][-1]["content"]
    return isinstance(content, list) and any(b.get("type") == "tool_result" for b in content)


Reply = dict[str, Any]  # {"text": ...} or {"tool": name, "input": {...}}


def default_script(body: dict[str, Any]) -> Reply:
    """Main conversation: run ``ls`` with Bash (or start a subagent when asked to), then
    finish once the result is back; a subagent answers at once; anything else (titles,
    summaries) gets a short text."""
    if is_subagent(body):
        return {"text": "The repository has a README and a src directory."}
    if not body.get("tools"):
        return {"text": '{"title": "Repository overview"}'}
    if last_has_tool_result(body):
        return {"text": "Done."}
    prompt = text_of(body["messages"][-1]["content"]).lower()
    if "subagent" in prompt:
        return {"tool": "Agent", "input": {"description": "Survey files", "prompt": "List the files here.",
                                           "subagent_type": "general-purpose"}}
    return {"tool": "Bash", "input": {"command": "ls", "description": "List files"}}


def _sse(body: dict[str, Any], reply: Reply, n: int) -> bytes:
    message = {"id": f"msg_rec{n}", "type": "message", "role": "assistant", "model": body.get("model", "m"),
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 1}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": message})]
    if "tool" in reply:
        block = {"type": "tool_use", "id": f"toolu_rec{n}", "name": reply["tool"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(reply["input"])}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": reply["text"]}
        stop = "end_turn"
    events += [("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
               ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
               ("content_block_stop", {"type": "content_block_stop", "index": 0}),
               ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                  "usage": {"output_tokens": 5}}),
               ("message_stop", {"type": "message_stop"})]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def _json(body: dict[str, Any], reply: Reply, n: int) -> bytes:
    if "tool" in reply:
        content = [{"type": "tool_use", "id": f"toolu_rec{n}", "name": reply["tool"], "input": reply["input"]}]
    else:
        content = [{"type": "text", "text": reply["text"]}]
    return json.dumps({"id": f"msg_rec{n}", "type": "message", "role": "assistant", "model": body.get("model", "m"),
                       "content": content, "stop_reason": "tool_use" if "tool" in reply else "end_turn",
                       "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}}).encode()


def _answer(script: Callable[[dict[str, Any]], Reply]) -> Answer:
    def answer(path: str, body: dict[str, Any], n: int) -> tuple[bytes, str]:
        if not path.startswith("/v1/messages") or "count_tokens" in path:
            return json.dumps({"input_tokens": 100}).encode(), "application/json"
        if body.get("stream"):
            return _sse(body, script(body), n), "text/event-stream"
        return _json(body, script(body), n), "application/json"

    return answer


def stand_in(script: Callable[[dict[str, Any]], Reply] = default_script) -> RecordingServer:
    """The Anthropic API's stand-in, answering from ``script``."""
    return RecordingServer(_answer(script))


SESSION_PROMPTS = ("List the files here.", "Now use a subagent to survey the files.")


def record_headless_session(claude: Path, work: Path, home: Path, env: dict[str, str]) -> list[Recorded]:
    """Run the real CLI headless, twice, in a fresh git repository ``work``: turn 1 has a
    Bash round trip; a file changes (the CLI's git status snapshot with it); turn 2 (``-c``)
    starts a subagent between two main requests. ``env`` is the CLI's environment without
    ``ANTHROPIC_BASE_URL`` (set here). Returns the /v1/messages requests, in order."""
    git = ["git", "-c", "user.email=dev@example.com", "-c", "user.name=dev"]
    (work / "README.md").write_text("# demo\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run([*git, *args], cwd=work, check=True, capture_output=True)
    recorder = stand_in()
    try:
        for turn, prompt in enumerate(SESSION_PROMPTS):
            if turn:
                (work / "notes.txt").write_text("changed between the turns\n")
            done = subprocess.run([str(claude), *(["-c"] if turn else []), "-p", prompt, "--output-format", "json",
                                   "--max-turns", "4", "--model", "claude-sonnet-5", "--dangerously-skip-permissions"],
                                  cwd=work, env={**env, "ANTHROPIC_BASE_URL": recorder.url, "HOME": str(home)},
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"claude exited with {done.returncode}: {done.stdout} {done.stderr}")
    finally:
        recorder.close()
    return [r for r in recorder.requests if r.path.startswith("/v1/messages") and "count_tokens" not in r.path]
