"""A title request behind a long cold prefill: how long does the side request wait?

    .venv/bin/python benchmarks/side_request.py [--model qwen2.5-coder-0.5b] [--long-tokens 9400]

Claude Code sends a short request of its own (a ~400-token title or quota check) while
its ~9.4K-token main request is still being prefilled. One real server, greedy: the
title request is timed alone (cold, three times, each with new text), then once at each
of 10%, 50% and 85% of the long prompt's prefill (read from the stream's
``: prefill N/M`` comments), each time with new text, so each is a cold 400-token
prefill behind the long one. Time to first token from the request's sending. Prints a
table, writes benchmarks/results/side_request.json and side_request.png (``--baseline``:
an earlier run's JSON, another commit's, drawn beside).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import anthropic_stream, http_client, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.interleave import text_of  # noqa: E402
from support.servers import start_server, stop_server  # noqa: E402

PROGRESS = re.compile(r"^: prefill (\d+)/(\d+) prompt tokens")
AT = (0.10, 0.50, 0.85)  # fractions of the long prefill at which a title request is sent


def model_path(name: str) -> Path:
    """A model directory, or an embedded model's name (installed if missing)."""
    path = Path(name)
    return path if path.is_dir() else ensure_embedded(load_settings().models_dir, name)


def title(url: str, seed: int, tokens: int) -> float:
    body = {"model": "m", "max_tokens": 8, "temperature": 0,
            "system": "Write a short title for the conversation below, five words at most.",
            "messages": [{"role": "user", "content": text_of(tokens, 100 + seed)}]}
    ttft, _, _ = anthropic_stream(f"{url}/v1/messages", body, {"x-session-id": f"title-{seed}"})
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model directory or an embedded model's name")
    parser.add_argument("--long-tokens", type=int, default=9400)
    parser.add_argument("--title-tokens", type=int, default=400)
    parser.add_argument("--baseline", type=Path, help="an earlier run's side_request.json, plotted beside")
    args = parser.parse_args()
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-side-")), model_path(args.model), timeout_s=600)
    progress = [0.0]
    long: dict[str, float] = {}
    try:
        title(server.url, 0, args.title_tokens)  # warm-up: the first request's one-time costs
        alone = [title(server.url, seed, args.title_tokens) for seed in (1, 2, 3)]

        def long_request() -> None:
            body = {"model": "m", "max_tokens": 8, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": text_of(args.long_tokens, 2)}]}
            start = time.perf_counter()
            with http_client().stream("POST", f"{server.url}/v1/messages", json=body, timeout=3600,
                                      headers={"x-session-id": "main"}) as response:
                for line in response.iter_lines():
                    if (match := PROGRESS.match(line)) is not None:
                        progress[0] = int(match[1]) / int(match[2])
                    elif '"content_block_delta"' in line and "ttft_s" not in long:
                        long["ttft_s"] = time.perf_counter() - start
            long["total_s"] = time.perf_counter() - start

        thread = threading.Thread(target=long_request)
        thread.start()
        behind = []
        for i, fraction in enumerate(AT):
            while progress[0] < fraction and thread.is_alive():
                time.sleep(0.05)
            behind.append(title(server.url, 10 + i, args.title_tokens))
        thread.join()
    finally:
        stop_server(server)
    rows = [["alone", *alone, max(alone)], ["behind the long prefill", *behind, max(behind)]]
    print_table(["title request, TTFT (s)", "1", "2", "3", "worst"], rows)
    print(f"behind: sent at {', '.join(f'{f:.0%}' for f in AT)} of the long prompt's prefill; "
          f"the long prompt ({args.long_tokens} tokens asked): TTFT {long.get('ttft_s', 0):.1f} s")
    results = {"args": vars(args), "alone_ttft_s": alone, "behind_ttft_s": behind, "behind_at": list(AT),
               "long": long}
    path = write_results("side_request", results)
    print(f"wrote {path}")
    plot(results, json.loads(args.baseline.read_text()) if args.baseline else None)


def plot(results: dict, baseline: dict | None) -> None:
    """Bars of the title request's TTFT, alone and behind; ``baseline``: an earlier run's
    results (another commit), drawn beside."""
    plt = pyplot()
    if plt is None:
        return
    runs = [(f"at {baseline['machine']['commit']}", baseline)] if baseline else []
    runs.append((f"at {results.get('machine', {}).get('commit', 'this commit')}", results))
    labels = [f"alone {i}" for i in (1, 2, 3)] + [f"at {f:.0%}" for f in results["behind_at"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(runs)
    for i, (name, run) in enumerate(runs):
        ax.bar([x + i * width for x in range(len(labels))], run["alone_ttft_s"] + run["behind_ttft_s"], width,
               label=name)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("title request TTFT (s)")
    ax.legend()
    args = results["args"]
    ax.set_title(f"A {args['title_tokens']}-token title behind a {args['long_tokens']}-token prefill "
                 f"({Path(args['model']).name})")
    save_plot(fig, "side_request")

if __name__ == "__main__":
    main()
