"""Short turns on a long conversation: +20 new tokens at 3K and 6K context, Semantic warm
against Semantic cold (reuse off) and against mlx_lm.server, in one run.

    .venv/bin/python benchmarks/short_turns.py [--contexts 3000 6000]

For each context a conversation of about that many tokens is built (one long user
message, a reply); then the next turn adds ~20 tokens. TTFT of that turn, streamed,
greedy, 8-token replies, OpenAI API on all three (the same SmolLM2 directory and
OpenBLAS): Semantic with its cache, Semantic with SEMANTIC_CACHE_REUSE=0, and
mlx_lm.server 0.32.2 holding the conversation in its in-memory prompt cache. Prints a
table, writes benchmarks/results/short_turns.json and short_turns.png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.interleave import text_of  # noqa: E402
from benchmarks.peers import MLX_LM_MODEL, mlx_lm_server  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

SHORT = "Which word came first? Answer in one word."  # ~20 tokens with the template's markers


def turn(url: str, messages: list[dict], session: str | None) -> tuple[float, str]:
    body = {"model": MLX_LM_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            **({"session_id": session} if session else {})}
    ttft, text, _ = openai_stream(f"{url}/v1/chat/completions", body)
    return ttft, text


def measure(url: str, context: int, session: str | None) -> float:
    """Build the conversation, then time the short turn on top of it."""
    messages = [{"role": "user", "content": text_of(context, context)}]
    _, reply = turn(url, messages, session)
    messages += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": SHORT}]
    return turn(url, messages, session)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[3000, 6000])
    args = parser.parse_args()
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    home = Path(tempfile.mkdtemp(prefix="semantic-short-"))
    results = {c: {} for c in args.contexts}
    for name, extra in (("semantic", {}), ("cold", {"SEMANTIC_CACHE_REUSE": "0"})):
        server = start_server(home / name, model_dir, extra)
        try:
            for context in args.contexts:
                results[context][name] = measure(server.url, context, f"short-{context}")
        finally:
            stop_server(server)
    peer = mlx_lm_server(model_dir, home / "mlx_lm.log")
    try:
        for context in args.contexts:
            results[context]["mlx_lm"] = measure(peer.url, context, None)
    finally:
        peer.stop()
    rows = [[c, r["semantic"], r["cold"], r["mlx_lm"], r["cold"] / r["semantic"], r["mlx_lm"] / r["semantic"]]
            for c, r in results.items()]
    print_table(["context", "Semantic warm s", "cold s", "mlx_lm.server s", "cold/warm", "mlx_lm/Semantic"], rows)
    print(f"wrote {write_results('short_turns', {'args': vars(args), 'ttft_s': results})}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.27
        for i, (key, label) in enumerate((("semantic", "Semantic warm"), ("cold", "cold (reuse off)"),
                                          ("mlx_lm", "mlx_lm.server"))):
            ax.bar([x + (i - 1) * width for x in range(len(rows))], [results[c][key] for c in results], width,
                   label=label)
        ax.set_xticks(range(len(rows)), [f"{c} tokens + ~20" for c in results])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title("A short turn on a long conversation (SmolLM2-135M, 2-core CPU)")
        ax.legend()
        save_plot(fig, "short_turns")


if __name__ == "__main__":
    main()
