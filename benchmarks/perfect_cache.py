"""Prefill against a perfect cache, on a recorded Claude Code session.

    .venv/bin/python benchmarks/perfect_cache.py [--sessions 3]

The pinned CLI's recorded session (``claude_code_session.py``'s: two headless turns with a
Bash round trip, a file change, a subagent between two main requests, and a title request
after the first) is replayed against one real Semantic server on SmolLM2, ``--sessions``
times, each a new session of the same project (its own session id, as a user's next
``claude`` run), streamed, greedy, 16-token replies, each conversation continued with the
server's own answers.

A perfect cache prefills each distinct token once: a request's prompt costs it only the
tokens after the longest prefix it shares with anything computed before it in the run, an
earlier prompt or an earlier prompt followed by its reply (token ids of the prompt Semantic
rendered, through the model's chat template; a reply's text tokenized on its own). The
sessions after the first repeat the first's requests, so a perfect cache prefills next to
nothing of them: what Semantic prefills there is its own cost of a new session. Semantic's cost is what
it reports: prompt tokens less cached ones. Per request and overall: both, their ratio,
and Semantic's hit rate. Prints a table, writes benchmarks/results/perfect_cache.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.cache.matcher import common_tokens  # noqa: E402
from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.claude_code_session import (  # noqa: E402
    anthropic_turn, install_claude, record_session, rendered_messages, with_own_replies)
from benchmarks.common import print_table, write_results  # noqa: E402
from support.servers import start_server, stop_server  # noqa: E402


def renamed(request: dict[str, Any], session: str) -> dict[str, Any]:
    """The request as a new session of the same project sends it (its own session id)."""
    old = request["headers"].get("X-Claude-Code-Session-Id", "")
    headers = {**request["headers"], "X-Claude-Code-Session-Id": session}
    metadata = {k: v.replace(old, session) if old and isinstance(v, str) else v
                for k, v in request["body"].get("metadata", {}).items()}
    return {**request, "headers": headers, "body": {**request["body"], "metadata": metadata}}


def replay(url: str, requests: list[dict[str, Any]], tokenizer: Any, seen: list[list[int]]) -> list[dict[str, Any]]:
    """One session's requests, each with Semantic's prompt and cached tokens and the perfect
    cache's new tokens (``seen``: every earlier prompt's ids, this one's added)."""
    sent: dict[str, tuple[int, list, Any]] = {}
    snapshots: dict[str, str] = {}
    rows = []
    for request in requests:
        messages = with_own_replies(sent, request)
        body = {**request["body"], "messages": messages}
        chat, snapshots[request["kind"]] = rendered_messages(body, snapshots.get(request["kind"]))
        ids = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
        shared = max((common_tokens(ids, earlier) for earlier in seen), default=0)
        seen.append(ids)
        ttft, message = anthropic_turn(url, body, request["headers"])
        usage = message.usage
        total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        rows.append({"kind": request["kind"], "prompt_tokens": total, "cached_tokens": usage.cache_read_input_tokens,
                     "prefilled": total - usage.cache_read_input_tokens, "rendered_tokens": len(ids),
                     "perfect_prefilled": len(ids) - shared, "ttft_s": ttft})
        reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        sent[request["kind"]] = (len(request["body"]["messages"]), messages, reply)
        # What the turn computed is the prompt and its reply: a perfect cache keeps both (the
        # reply's text tokenized alone: a token or two may differ at the seam).
        text = "".join(getattr(b, "text", "") for b in message.content)
        seen.append(ids + tokenizer.encode(text, add_special_tokens=False))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = record_session(install_claude())
    print(f"recorded {len(requests)} requests: {[r['kind'] for r in requests]}", file=sys.stderr)
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-perfect-")), model_dir,
                          {"SEMANTIC_DEFAULT_TEMPERATURE": "0", "SEMANTIC_REPETITION_PENALTY": "1.3"})
    seen: list[list[int]] = []
    sessions = []
    try:
        for n in range(args.sessions):
            session = str(uuid.UUID(int=n + 1))
            sessions.append(replay(server.url, [renamed(r, session) for r in requests], tokenizer, seen))
    finally:
        stop_server(server)
    table = []
    for n, rows in enumerate(sessions, start=1):
        for i, row in enumerate(rows, start=1):
            table.append([n, f"{i} {row['kind']}", row["prompt_tokens"], row["rendered_tokens"], row["cached_tokens"],
                          row["prefilled"], row["perfect_prefilled"],
                          row["prefilled"] / row["perfect_prefilled"] if row["perfect_prefilled"] else "-"])
    print_table(["session", "request", "prompt", "rendered here", "cached", "Semantic prefilled",
                 "perfect cache prefilled", "ratio"], table)
    per_session = []
    for rows in sessions:
        ours, perfect = sum(r["prefilled"] for r in rows), sum(r["perfect_prefilled"] for r in rows)
        prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
        per_session.append({"prefilled": ours, "perfect_prefilled": perfect, "ratio": ours / perfect if perfect else None,
                            "hit_rate": cached / prompt})
    rows_all = [r for rows in sessions for r in rows]
    overall = {"prefilled": sum(r["prefilled"] for r in rows_all),
               "perfect_prefilled": sum(r["perfect_prefilled"] for r in rows_all),
               "hit_rate": sum(r["cached_tokens"] for r in rows_all) / sum(r["prompt_tokens"] for r in rows_all)}
    overall["ratio"] = overall["prefilled"] / overall["perfect_prefilled"]
    print_table(["session", "Semantic prefilled", "perfect cache", "ratio", "hit rate"],
                [[n, s["prefilled"], s["perfect_prefilled"], "-" if s["ratio"] is None else s["ratio"], s["hit_rate"]]
                 for n, s in enumerate([*per_session, overall], start=1)])
    path = write_results("perfect_cache", {"args": vars(args), "sessions": sessions, "per_session": per_session,
                                           "overall": overall})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
