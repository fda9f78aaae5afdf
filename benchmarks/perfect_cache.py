"""Prefill against a perfect cache: recorded Claude Code and Codex sessions, and synthetic
40-turn agent sessions with a subagent and a compaction.

    .venv/bin/python benchmarks/perfect_cache.py [--model qwen2.5-coder-0.5b] [--sessions 3]
        [--synthetic 3] [--turns 40]

One real Semantic server (greedy, 16-token replies, streamed), every conversation continued
with the server's own answers, runs in order:

- ``claude``: the pinned Claude Code CLI's recorded session (``claude_code_session.py``'s: two
  headless turns with a Bash round trip, a file change, a subagent between two main
  requests, a title request after the first), ``--sessions`` times, each a new session of
  the same project (its own session id, as a user's next ``claude`` run);
- ``codex``: the pinned Codex CLI's recorded two turns (``tests/unit/data/codex_requests.json``:
  ``codex exec``, then ``codex exec resume --last``), ``--sessions`` times, each with its own
  session id;
- ``synthetic``: ``--synthetic`` sessions of ``--turns`` main turns shaped like the published
  agent traces (median 33-43 turns; subagents in 44% of sessions: here every other session).
  Each starts as the recorded session's first main request (Claude Code's own system
  prompt and tools), sends a title request after it, and then each turn answers the reply
  with a tool's output (a call's ``tool_result``, or a user message): a slice of this
  repository's source, ~150 tokens, different in each session. A subagent (the recorded
  subagent request, then three more turns of its own) runs at a quarter of the way, and
  its last answer goes back to the main conversation; at 70% of the turns the session is
  compacted as Claude Code does it: a summary request over the whole conversation, then
  a new conversation that starts from the summary.

A perfect cache prefills each distinct token once: a request's prompt costs it only the
tokens after the longest prefix it shares with anything computed before it in the run, an
earlier prompt or an earlier prompt followed by its reply. The prompt's token ids are the
ones Semantic renders (the protocol's parser and the engine's renderer, the conversation's
pinned snapshot; the table's "rendered" column must equal the server's prompt tokens); a
reply's are its text (and a tool call's name and arguments) tokenized on its own, so a token
or two at the seam may differ. Semantic's cost is what it reports: prompt tokens less cached
ones. Per request, per session and per kind of session: both, their ratio, and Semantic's
hit rate. Prints tables, writes benchmarks/results/perfect_cache.json.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.servers import start_server, stop_server  # noqa: E402

from app.cache.matcher import common_tokens  # noqa: E402
from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.prompting import render_chat  # noqa: E402
from app.engine.tool_syntax import tool_syntax  # noqa: E402
from app.protocol import anthropic as anthropic_protocol  # noqa: E402
from app.protocol import responses as responses_protocol  # noqa: E402
from app.settings import load_settings  # noqa: E402
from app.types import RequestOptions  # noqa: E402
from benchmarks.claude_code_session import anthropic_turn, install_claude, record_session, with_own_replies  # noqa: E402
from benchmarks.common import http_client, print_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODEX_RECORDING = ROOT / "tests" / "unit" / "data" / "codex_requests.json"
MAX_TOKENS = 16
TOOL_OUTPUT_CHARS = 600  # ~150 tokens of source a turn
COMPACT_PROMPT = ("Your task is to create a detailed summary of the conversation so far, paying close attention to "
                  "the user's explicit requests and your previous actions.")
CONTINUED = ("This session is being continued from a previous conversation that ran out of context. "
             "The conversation is summarized below:\n")


class PerfectCache:
    """Every sequence computed so far, sorted: the longest prefix a new one shares with any of
    them is the one it shares with its neighbour on either side."""

    def __init__(self) -> None:
        self._computed: list[tuple[int, ...]] = []

    def new_tokens(self, ids: list[int]) -> int:
        """Tokens of ``ids`` after the longest prefix it shares with anything computed."""
        key = tuple(ids)
        at = bisect.bisect_left(self._computed, key)
        shared = max((common_tokens(key, self._computed[i]) for i in (at - 1, at) if 0 <= i < len(self._computed)),
                     default=0)
        return len(key) - shared

    def keep(self, ids: list[int]) -> None:
        bisect.insort(self._computed, tuple(ids))


class Renderer:
    """The token ids Semantic renders for a request body: the protocol's parser in the
    model's tool format, the conversation's pinned snapshot, the engine's renderer."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.utils import load_tokenizer

        config = json.loads((model_dir / "config.json").read_text())
        self.tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
        self.options = replace(load_settings().request_options, tool_syntax=tool_syntax(self.tokenizer))
        self.snapshots: dict[tuple[str, str], str] = {}

    def ids(self, parse: Callable[[Any, RequestOptions], Any], body: dict[str, Any],
            conversation: tuple[str, str]) -> list[int]:
        parsed = parse(body, self.options).with_snapshot(self.snapshots.get(conversation))
        self.snapshots.setdefault(conversation, parsed.snapshot)
        return list(render_chat(self.tokenizer, parsed.messages, parsed.reply_prefix, tools=parsed.tool_specs,
                                prefill=parsed.prefill).token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class Run:
    """One server's requests in order, each with what Semantic and a perfect cache prefilled."""

    def __init__(self, url: str, renderer: Renderer) -> None:
        self.url = url
        self.renderer = renderer
        self.perfect = PerfectCache()
        self.rows: list[dict[str, Any]] = []

    def _record(self, session: str, kind: str, ids: list[int], perfect: int, prompt: int, cached: int,
                ttft: float, reply: str) -> None:
        self.perfect.keep(ids + self.renderer.encode(reply))
        self.rows.append({"session": session, "kind": kind, "prompt_tokens": prompt, "cached_tokens": cached,
                          "prefilled": prompt - cached, "rendered_tokens": len(ids), "perfect_prefilled": perfect,
                          "ttft_s": ttft})

    def anthropic(self, session: str, kind: str, body: dict[str, Any], headers: dict[str, str]) -> list[dict[str, Any]]:
        """One Messages request; the reply's content blocks."""
        ids = self.renderer.ids(anthropic_protocol.parse_request, body, (session, kind))
        perfect = self.perfect.new_tokens(ids)
        self.perfect.keep(ids)
        ttft, message = anthropic_turn(self.url, body, headers)
        usage = message.usage
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        self._record(session, kind, ids, perfect,
                     usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens,
                     usage.cache_read_input_tokens, ttft, reply_text(blocks))
        return blocks

    def responses(self, session: str, kind: str, body: dict[str, Any], headers: dict[str, str]) -> list[dict[str, Any]]:
        """One streamed Responses request; the response's output items."""
        ids = self.renderer.ids(responses_protocol.parse_request, body, (session, kind))
        perfect = self.perfect.new_tokens(ids)
        self.perfect.keep(ids)
        ttft, response = responses_stream(f"{self.url}/v1/responses", body, headers)
        usage = response["usage"]
        text = "".join(part.get("text", "") for item in response["output"] if item.get("type") == "message"
                       for part in item.get("content", []))
        self._record(session, kind, ids, perfect, usage["input_tokens"],
                     (usage.get("input_tokens_details") or {}).get("cached_tokens", 0), ttft, text)
        return response["output"]


def responses_stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """POST a streamed Responses request: (seconds to the first output delta, the completed
    response). Raises RuntimeError on an error status or a stream without ``response.completed``."""
    start, ttft = time.perf_counter(), None
    with http_client().stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"].endswith(".delta") and ttft is None:
                ttft = time.perf_counter() - start
            if event["type"] == "response.completed":
                return ttft or time.perf_counter() - start, event["response"]
    raise RuntimeError(f"{url}: the stream ended without response.completed")


def reply_text(blocks: list[dict[str, Any]]) -> str:
    """What a reply computed, as text: its text blocks, and each tool call's name and input."""
    return "".join(b["text"] if b["type"] == "text" else json.dumps({"name": b["name"], "arguments": b["input"]})
                   for b in blocks if b["type"] in ("text", "tool_use"))


def renamed(value: Any, old: str, new: str) -> Any:
    """``value`` (JSON) with every occurrence of the session id ``old`` replaced by ``new``."""
    return json.loads(json.dumps(value).replace(old, new)) if old else value


def claude_session(run: Run, requests: list[dict[str, Any]], session: str) -> None:
    old = requests[0]["headers"].get("X-Claude-Code-Session-Id", "")
    sent: dict[str, tuple[int, list, Any]] = {}
    for request in renamed(requests, old, session):
        messages = with_own_replies(sent, request)
        blocks = run.anthropic(session, request["kind"], {**request["body"], "messages": messages}, request["headers"])
        sent[request["kind"]] = (len(request["body"]["messages"]), messages,
                                 {"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]})


def codex_session(run: Run, recording: dict[str, Any], model: str, session: str) -> None:
    """The recorded two turns: turn 1's input is turn 2's first four items; turn 2 sends the
    server's own answer in place of the recorded one."""
    old = recording["body"]["prompt_cache_key"]
    body = renamed({**recording["body"], "model": model}, old, session)
    headers = [renamed(h, old, session) for h in recording["headers"]]
    items = body["input"]
    output = run.responses(session, "main", {**body, "input": items[:4]}, headers[0])
    run.responses(session, "main", {**body, "input": [*items[:4], *output, *items[5:]]}, headers[1])


def tool_outputs(session: int) -> Iterator[str]:
    """Slices of this repository's source, a different stretch for each session."""
    text = "".join(path.read_text() for path in sorted((ROOT / "app").rglob("*.py")))
    at = session * 40 * TOOL_OUTPUT_CHARS * 2
    while True:
        at %= len(text) - TOOL_OUTPUT_CHARS
        yield text[at:at + TOOL_OUTPUT_CHARS]
        at += TOOL_OUTPUT_CHARS


def answer(blocks: list[dict[str, Any]], output: str) -> dict[str, Any]:
    """The user's next message after a reply: each tool call's result, or the output as text."""
    calls = [b for b in blocks if b["type"] == "tool_use"]
    if calls:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": output}
                                            for b in calls]}
    return {"role": "user", "content": [{"type": "text", "text": output}]}


def assistant(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]}


def synthetic_session(run: Run, requests: list[dict[str, Any]], n: int, turns: int, subagent: bool) -> None:
    session = str(uuid.UUID(int=1000 + n))
    old = requests[0]["headers"].get("X-Claude-Code-Session-Id", "")
    first, title = (renamed(r, old, session) for r in requests[:2])
    sub = renamed(next(r for r in requests if r["kind"] == "subagent"), old, session)
    outputs = tool_outputs(n)
    body, headers = first["body"], first["headers"]
    messages = list(body["messages"])
    blocks = run.anthropic(session, "main", {**body, "messages": messages}, headers)
    run.anthropic(session, "title", title["body"], headers)
    subagent_at, compact_at = (turns // 4 if subagent else -1), int(turns * 0.7)
    for turn in range(2, turns + 1):
        messages.append(assistant(blocks))
        if turn == subagent_at:
            sub_messages = list(sub["body"]["messages"])
            for step in range(4):
                sub_blocks = run.anthropic(session, "subagent", {**sub["body"], "messages": sub_messages},
                                           sub["headers"])
                if step < 3:
                    sub_messages += [assistant(sub_blocks), answer(sub_blocks, next(outputs))]
            messages.append(answer(blocks, "Subagent report: " + (reply_text(sub_blocks) or "(empty)")))
        elif turn == compact_at:
            last = answer(blocks, next(outputs))
            last["content"].append({"type": "text", "text": COMPACT_PROMPT})
            summary = run.anthropic(session, "compact", {**body, "messages": [*messages, last]}, headers)
            messages = [{"role": "user", "content": [{"type": "text", "text": CONTINUED + (reply_text(summary) or "-")
                                                      + "\n\n" + next(outputs)}]}]
        else:
            messages.append(answer(blocks, next(outputs)))
        blocks = run.anthropic(session, "main", {**body, "messages": messages}, headers)


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ours, perfect = sum(r["prefilled"] for r in rows), sum(r["perfect_prefilled"] for r in rows)
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    return {"requests": len(rows), "prompt_tokens": prompt, "prefilled": ours, "perfect_prefilled": perfect,
            "ratio": ours / perfect if perfect else None, "hit_rate": cached / prompt if prompt else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="an embedded model (its context must hold "
                        "a synthetic session: SmolLM2's 8K does not)")
    parser.add_argument("--sessions", type=int, default=3, help="of each recorded CLI")
    parser.add_argument("--synthetic", type=int, default=3)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--kinds", nargs="+", default=["claude", "codex", "synthetic"],
                        choices=["claude", "codex", "synthetic"], help="the kinds of session to run")
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, args.model)
    requests = record_session(install_claude())
    print(f"recorded {len(requests)} requests: {[r['kind'] for r in requests]}", file=sys.stderr)
    recording = json.loads(CODEX_RECORDING.read_text())
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-perfect-")), model_dir,
                          {"SEMANTIC_DEFAULT_TEMPERATURE": "0", "SEMANTIC_REPETITION_PENALTY": "1.3"})
    run = Run(server.url, Renderer(model_dir))
    kinds: dict[str, list[str]] = {kind: [] for kind in args.kinds}
    try:
        for n in range(args.sessions if "claude" in kinds else 0):
            kinds["claude"].append(session := str(uuid.UUID(int=n + 1)))
            claude_session(run, requests, session)
            print(f"claude session {n + 1} done", file=sys.stderr)
        for n in range(args.sessions if "codex" in kinds else 0):
            kinds["codex"].append(session := str(uuid.UUID(int=100 + n)))
            codex_session(run, recording, args.model, session)
            print(f"codex session {n + 1} done", file=sys.stderr)
        for n in range(args.synthetic if "synthetic" in kinds else 0):
            kinds["synthetic"].append(str(uuid.UUID(int=1000 + n)))
            synthetic_session(run, requests, n, args.turns, subagent=n % 2 == 0)
            print(f"synthetic session {n + 1} done", file=sys.stderr)
    finally:
        stop_server(server)

    mismatched = [r for r in run.rows if r["rendered_tokens"] != r["prompt_tokens"]]
    print_table(["session", "request", "prompt", "rendered here", "cached", "Semantic prefilled",
                 "perfect cache prefilled"],
                [[r["session"][-4:], r["kind"], r["prompt_tokens"], r["rendered_tokens"], r["cached_tokens"],
                  r["prefilled"], r["perfect_prefilled"]] for r in run.rows])
    per_session = {session: totals([r for r in run.rows if r["session"] == session])
                   for sessions in kinds.values() for session in sessions}
    per_kind = {kind: totals([r for r in run.rows if r["session"] in sessions]) for kind, sessions in kinds.items()}
    overall = totals(run.rows)
    by_request: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in run.rows}):
        by_request[kind] = totals([r for r in run.rows if r["kind"] == kind])
    columns = ["", "requests", "prompt tokens", "Semantic prefilled", "perfect cache", "ratio", "hit rate"]

    def line(name: str, t: dict[str, Any]) -> list[Any]:
        return [name, t["requests"], t["prompt_tokens"], t["prefilled"], t["perfect_prefilled"],
                "-" if t["ratio"] is None else t["ratio"], "-" if t["hit_rate"] is None else t["hit_rate"]]

    print_table(columns, [line(f"{kind} {i + 1}", per_session[s]) for kind, sessions in kinds.items()
                          for i, s in enumerate(sessions)]
                + [line(f"all {kind}", per_kind[kind]) for kind in kinds] + [line("overall", overall)])
    print_table(columns, [line(kind, t) for kind, t in by_request.items()])
    if mismatched:
        print(f"warning: {len(mismatched)} requests rendered here to other token counts than the server's",
              file=sys.stderr)
    path = write_results("perfect_cache", {"args": vars(args), "rows": run.rows, "per_session": per_session,
                                           "per_kind": per_kind, "by_request": by_request, "overall": overall,
                                           "rendered_mismatches": len(mismatched)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
