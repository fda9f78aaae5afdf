"""The real Codex CLI against Semantic, turn by turn, next to Claude Code at a similar prompt size.

    .venv/bin/python benchmarks/codex_session.py [--turns 4]

One server (the embedded SmolLM2, greedy with repetition penalty 1.3, as the CLI tests run it).
Codex 0.169.0 (``codex exec``, then ``codex exec resume --last`` for each further turn; its
first request is ~5,600 tokens) and Claude Code 2.1.197 (``claude -p``, then ``claude -c -p``,
``--tools Bash,Read``: ~6,000 tokens), both pinned and installed from npm into .cache like the
tests. For every request the server's own record (``requests``): prompt tokens, tokens read
from cache, TTFT (admission to first token, so the CLIs' start-up is not counted). Prints a
table, writes benchmarks/results/codex_session.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402
from conftest import CLAUDE_CODE, CODEX, npm_cli  # noqa: E402
from support.servers import claude_env, start_server, stop_server  # noqa: E402
from support.codex_recorder import codex_env, run_codex, write_config  # noqa: E402
from support.dbcheck import query  # noqa: E402

PROMPTS = ("What is 2+2?", "And 3+3?", "And 4+4?", "And 5+5?", "And 6+6?")


def codex_session(server_url: str, scratch: Path, turns: int) -> None:
    codex = npm_cli(CODEX, "codex")
    write_config(scratch / "codex-home", f"{server_url}/v1")
    (scratch / "codex-work").mkdir()
    env = codex_env(scratch / "codex-home", scratch)
    for turn in range(turns):
        done = run_codex(codex, scratch / "codex-work", env, PROMPTS[turn], resume=turn > 0)
        if done.returncode != 0:
            raise RuntimeError(f"codex failed: {done.stdout} {done.stderr[-2000:]}")


def claude_session(server_url: str, scratch: Path, turns: int) -> None:
    claude = npm_cli(CLAUDE_CODE, "claude")
    work, home = scratch / "claude-work", scratch / "claude-home"
    work.mkdir()
    home.mkdir()
    env = {**claude_env(server_url, home), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300"}
    for turn in range(turns):
        done = subprocess.run([str(claude), *(["-c"] if turn else []), "-p", PROMPTS[turn], "--output-format", "json",
                               "--max-turns", "2", "--tools", "Bash,Read", "--model", "claude-sonnet-5"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"claude failed: {done.stdout} {done.stderr[-2000:]}")


def rows(db: Path, protocol: str) -> list[dict[str, Any]]:
    found = query(db, "SELECT n_input_tokens, n_cached_tokens, ttft_ms, reuse_reason FROM requests "
                  "WHERE protocol = ? AND status = 'ok' ORDER BY created_at", protocol)
    return [{"prompt_tokens": p, "cached_tokens": c, "ttft_s": t / 1000, "reuse_reason": r} for p, c, t, r in found]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=4, choices=range(2, len(PROMPTS) + 1))
    args = parser.parse_args()
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct", progress=False)
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        server = start_server(scratch / "home", model_dir, {"SEMANTIC_DEFAULT_TEMPERATURE": "0",
                                                            "SEMANTIC_REPETITION_PENALTY": "1.3"})
        try:
            codex_session(server.url, scratch, args.turns)
            claude_session(server.url, scratch, args.turns)
            clients = {"codex": rows(server.db_path, "responses"), "claude_code": rows(server.db_path, "anthropic")}
        finally:
            stop_server(server)
    table = []
    for client, requests in clients.items():
        for n, row in enumerate(requests, 1):
            share = row["cached_tokens"] / row["prompt_tokens"]
            table.append([client, n, row["prompt_tokens"], row["cached_tokens"], f"{share:.1%}", row["ttft_s"],
                          row["reuse_reason"]])
    print_table(["client", "request", "prompt tokens", "cached", "cached share", "TTFT s", "reuse reason"], table)
    warm = {client: statistics.median(r["ttft_s"] for r in requests[1:]) for client, requests in clients.items()}
    ratio = warm["codex"] / warm["claude_code"]
    print(f"median warm TTFT: Codex {warm['codex']:.2f} s, Claude Code {warm['claude_code']:.2f} s, "
          f"ratio {ratio:.2f}")
    write_results("codex_session", {"turns": args.turns, "requests": clients, "median_warm_ttft_s": warm,
                                    "codex_over_claude_code": ratio})
    plot(clients)


def plot(clients: dict[str, list[dict[str, Any]]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (client, requests) in enumerate(clients.items()):
        xs = [n + (k - 0.5) * width for n in range(2, len(requests) + 1)]
        bars = ax.bar(xs, [r["ttft_s"] for r in requests[1:]], width, label=client.replace("_", " "))
        for bar, r in zip(bars, requests[1:]):
            ax.annotate(f"{r['cached_tokens'] / r['prompt_tokens']:.1%}", (bar.get_x() + width / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(2, max(len(r) for r in clients.values()) + 1))
    ax.set_xlabel("request (the first, cold, not shown)")
    ax.set_ylabel("TTFT (s), cached share on top")
    ax.set_title("Warm turns of a CLI session, SmolLM2-135M, 2-core CPU")
    ax.legend()
    save_plot(fig, "codex_session")


if __name__ == "__main__":
    main()
