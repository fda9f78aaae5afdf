"""Workload 4: 1, 2, 4, 8 agents talking at once: aggregate decode speed and TTFT percentiles.

    .venv/bin/python benchmarks/concurrency.py [--levels 1 2 4 8] [--turns 3]

Each of N client threads drives its own agent (OpenAI API, streamed, greedy,
64-token replies) for a few turns, all at once against one real server. The
aggregate rate is all output tokens over the wall time; TTFT includes the
wait in the engine's queue. Prints a table, writes
benchmarks/results/concurrency.json and concurrency.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import user_message  # noqa: E402
from benchmarks.peer import SYSTEM  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

REPLY_TOKENS = 64


def agent(url: str, name: str, turns: int) -> list[tuple[float, int]]:
    """(TTFT, output tokens) per turn of one agent's conversation."""
    rng = random.Random(name)
    history = [SYSTEM]
    out = []
    for _ in range(turns):
        history.append({"role": "user", "content": user_message(rng, 150)})
        body = {"model": "m", "messages": history, "max_tokens": REPLY_TOKENS, "temperature": 0,
                "stream_options": {"include_usage": True}, "session_id": name}
        ttft, text, usage = openai_stream(f"{url}/v1/chat/completions", body)
        history.append({"role": "assistant", "content": text})
        out.append((ttft, usage.get("completion_tokens", 0)))
    return out


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-concurrency-")), model_dir)
    results = []
    try:
        for level in args.levels:
            start = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                runs = list(pool.map(lambda i: agent(server.url, f"c{level}-{i}", args.turns), range(level)))
            wall = time.perf_counter() - start
            ttfts = [t for run in runs for t, _ in run]
            tokens = sum(n for run in runs for _, n in run)
            results.append({"agents": level, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
                            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95)})
    finally:
        stop_server(server)

    print_table(["agents", "output tokens", "wall s", "aggregate tok/s", "TTFT p50 s", "TTFT p95 s"],
                [[r["agents"], r["output_tokens"], r["wall_s"], r["tokens_per_s"], r["ttft_p50_s"], r["ttft_p95_s"]]
                 for r in results])
    print(f"wrote {write_results('concurrency', {'args': vars(args), 'levels': results})}")
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    levels = [r["agents"] for r in results]
    left.plot(levels, [r["tokens_per_s"] for r in results], "o-")
    left.set_xlabel("concurrent agents")
    left.set_ylabel("aggregate tokens/s (prefill + decode wall)")
    right.plot(levels, [r["ttft_p50_s"] for r in results], "o-", label="p50")
    right.plot(levels, [r["ttft_p95_s"] for r in results], "o-", label="p95")
    right.set_xlabel("concurrent agents")
    right.set_ylabel("TTFT (s)")
    right.legend()
    fig.suptitle("Concurrent agents, one engine thread (no batching yet), SmolLM2-135M, 2-core CPU")
    save_plot(fig, "concurrency")


if __name__ == "__main__":
    main()
