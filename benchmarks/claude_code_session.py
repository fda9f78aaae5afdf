"""A Claude Code session replayed: main turns with side requests interleaved as the CLI sends
them, against Semantic and against mlx_lm.server in one run, and a control without side requests.

    .venv/bin/python benchmarks/claude_code_session.py

The pinned CLI (npm, installed into .cache like the tests do) runs headless against a
scripted stand-in that records what it sends (tests/support/claude_recorder.py): a git
repository, the full default tool set, turn 1 with a Bash round trip, a file change, turn
2 (``-c``) starting a subagent between two main requests. A title request shaped as the
interactive CLI sends it (no tools, same session id) is added right after main request 1,
as the interactive UI sends it. The sequence is replayed, streamed, 16-token greedy
replies, each server continuing its own conversations with its own answers:

- Semantic (Anthropic API, the recorded bodies and headers);
- mlx_lm.server 0.32.2 (OpenAI API), same model directory and OpenBLAS, given exactly the
  prompt Semantic rendered (system prompt with the compact tools, fitted and pinned the
  same way, each message's text);
- the control: Semantic, a new session, the main requests only.

Prints a table (TTFT and cache read per request), writes
benchmarks/results/claude_code_session.json and .png.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import anthropic  # noqa: E402

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.protocol import anthropic as protocol  # noqa: E402
from app.settings import load_settings  # noqa: E402
from app.types import RequestOptions  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.peers import MLX_LM_MODEL, mlx_lm_server  # noqa: E402
from conftest import CLAUDE_CODE, ROOT  # noqa: E402
from support.servers import claude_env, start_server, stop_server  # noqa: E402
from support.claude_recorder import is_subagent, record_headless_session  # noqa: E402
from support.dbcheck import query  # noqa: E402

MAX_TOKENS = 16
TITLE_SYSTEM = ("Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal of this "
                "coding session. Return JSON with a single \"title\" field.")
KEPT_HEADERS = ("X-Claude-Code-Session-Id", "anthropic-beta", "anthropic-version", "x-app", "User-Agent")


def install_claude() -> Path:
    install_dir = ROOT / ".cache" / "claude-code-2.1.197"
    binary = install_dir / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        subprocess.run(["npm", "install", "--prefix", str(install_dir), CLAUDE_CODE], check=True, timeout=600)
    return binary


def record_session(claude: Path) -> list[dict[str, Any]]:
    """(kind, headers, body) of every request a two-turn headless session sends, and a title
    request (as the interactive UI sends one) right after the first."""
    home = Path(tempfile.mkdtemp())
    recorded = record_headless_session(claude, Path(tempfile.mkdtemp()), home, claude_env("", home))
    requests = [{"kind": "subagent" if is_subagent(r.body) else "main",
                 "headers": {k: v for k, v in r.headers.items() if k in KEPT_HEADERS}, "body": r.body}
                for r in recorded]
    first = requests[0]
    title = {"kind": "title", "headers": first["headers"], "body": {
        "model": first["body"]["model"], "max_tokens": 512, "stream": True, "metadata": first["body"]["metadata"],
        "system": [{"type": "text", "text": TITLE_SYSTEM}],
        "messages": [{"role": "user", "content": first["body"]["messages"][-1]["content"]}],
        "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}}}
    return [first, title, *requests[1:]]


def with_own_replies(sent: dict[str, tuple[int, list, Any]], request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages with the conversation's earlier assistant turn replaced by the
    server's own answer (what the CLI would have resent)."""
    messages = copy.deepcopy(request["body"]["messages"])
    if request["kind"] in sent:
        n_recorded, previous, reply = sent[request["kind"]]
        messages = [*previous, reply, *messages[n_recorded + 1:]]
    return messages


def anthropic_turn(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, Any]:
    """(seconds to the first content delta, the final message) of one streamed request,
    sent as the CLI sends it (its fields beyond the SDK's own go as they are)."""
    client = anthropic.Anthropic(base_url=url, api_key="dummy-key", max_retries=0, timeout=1800)
    rest = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens", "stream")}
    start, ttft = time.perf_counter(), None
    with client.messages.stream(model=body["model"], messages=body["messages"], max_tokens=MAX_TOKENS,
                                extra_body=rest, extra_headers=headers) as stream:
        for event in stream:
            if event.type == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - start
        return ttft or time.perf_counter() - start, stream.get_final_message()


def semantic_run(url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sent: dict[str, tuple[int, list, Any]] = {}
    rows = []
    for request in requests:
        messages = with_own_replies(sent, request)
        ttft, message = anthropic_turn(f"{url}", {**request["body"], "messages": messages}, request["headers"])
        usage = message.usage
        total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        rows.append({"kind": request["kind"], "prompt_tokens": total, "cached_tokens": usage.cache_read_input_tokens,
                     "ttft_s": ttft})
        reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        sent[request["kind"]] = (len(request["body"]["messages"]), messages, reply)
    return rows


def rendered_messages(body: dict[str, Any], snapshot: str | None) -> tuple[list[dict[str, str]], str]:
    """The chat messages Semantic renders for ``body`` (fitted to the context, pinned snapshot)."""
    parsed = protocol.parse_request(body, replace(RequestOptions(), fit=True)).with_snapshot(snapshot)
    return [{"role": m.role, "content": m.content} for m in parsed.messages], parsed.snapshot


def mlx_run(url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sent: dict[str, tuple[int, list, Any]] = {}
    snapshots: dict[str, str] = {}
    rows = []
    for request in requests:
        messages = with_own_replies(sent, request)
        chat, snapshots[request["kind"]] = rendered_messages({**request["body"], "messages": messages},
                                                             snapshots.get(request["kind"]))
        ttft, text, usage = openai_stream(f"{url}/v1/chat/completions", {
            "model": MLX_LM_MODEL, "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream_options": {"include_usage": True}})
        rows.append({"kind": request["kind"], "prompt_tokens": usage.get("prompt_tokens"),
                     "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "ttft_s": ttft})
        sent[request["kind"]] = (len(request["body"]["messages"]), messages,
                                 {"role": "assistant", "content": text or "(empty)"})
    return rows


def main() -> None:
    settings = load_settings()
    model_dir = ensure_embedded(settings.models_dir, "smollm2-135m-instruct")
    requests = record_session(install_claude())
    print(f"recorded {len(requests)} requests: {[r['kind'] for r in requests]}")
    home = Path(tempfile.mkdtemp())
    runs = {}
    for name, sequence in (("semantic", requests), ("control", [r for r in requests if r["kind"] == "main"])):
        # Each on a fresh server: the control must not start from the first run's blocks.
        server = start_server(home / name, model_dir, {"SEMANTIC_DEFAULT_TEMPERATURE": "0",
                                                       "SEMANTIC_REPETITION_PENALTY": "1.3"})
        try:
            runs[name] = semantic_run(server.url, sequence)
        finally:
            stop_server(server)
        # How reuse ended for each request, from the server's own diagnostics (issue 9).
        reasons = query(server.db_path, "SELECT reuse_reason, diverge_part FROM requests "
                                        "WHERE status = 'ok' ORDER BY created_at")
        for row, (reason, part) in zip(runs[name], reasons, strict=True):
            row.update(reason=reason, diverge_part=part)
    semantic, control = runs["semantic"], runs["control"]
    peer = mlx_lm_server(model_dir, home / "mlx_lm.log")
    try:
        mlx = mlx_run(peer.url, requests)
    finally:
        peer.stop()

    controls = iter(control)
    table = []
    for i, (ours, theirs) in enumerate(zip(semantic, mlx)):
        ctrl = next(controls) if ours["kind"] == "main" else None
        table.append({"step": i + 1, "kind": ours["kind"], "prompt_tokens": ours["prompt_tokens"],
                      "semantic_cached": ours["cached_tokens"], "semantic_ttft_s": ours["ttft_s"],
                      "control_ttft_s": ctrl["ttft_s"] if ctrl else None,
                      "semantic_reason": ours["reason"], "semantic_diverge_part": ours["diverge_part"],
                      "mlx_lm_cached": theirs["cached_tokens"], "mlx_lm_ttft_s": theirs["ttft_s"]})
    print_table(["step", "request", "prompt", "Semantic cached", "reuse reason", "Semantic TTFT", "control TTFT",
                 "mlx_lm cached", "mlx_lm TTFT"],
                [[r["step"], r["kind"], r["prompt_tokens"], r["semantic_cached"],
                  r["semantic_reason"], r["semantic_ttft_s"],
                  "-" if r["control_ttft_s"] is None else r["control_ttft_s"],
                  "-" if r["mlx_lm_cached"] is None else r["mlx_lm_cached"], r["mlx_lm_ttft_s"]] for r in table])
    path = write_results("claude_code_session", {"requests": table, "max_tokens": MAX_TOKENS,
                                                 "claude_code": CLAUDE_CODE})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        steps = [f"{r['step']} {r['kind']}" for r in table]
        width = 0.27
        xs = range(len(table))
        ax.bar([x - width for x in xs], [r["semantic_ttft_s"] for r in table], width, label="Semantic")
        ax.bar(list(xs), [r["control_ttft_s"] or 0 for r in table], width, label="control (no side requests)")
        ax.bar([x + width for x in xs], [r["mlx_lm_ttft_s"] for r in table], width, label="mlx_lm.server")
        ax.set_xticks(list(xs), steps, rotation=20)
        ax.set_ylabel("TTFT (s)")
        ax.set_yscale("log")
        ax.set_title("Claude Code session replay (SmolLM2-135M, 2-core CPU)")
        ax.legend()
        save_plot(fig, "claude_code_session")


if __name__ == "__main__":
    main()
