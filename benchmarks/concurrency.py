"""Workload 4: 1, 2, 4, 8 agents talking at once: aggregate decode speed and TTFT percentiles.

    .venv/bin/python benchmarks/concurrency.py [--levels 1 2 4 8] [--turns 3] [--repeats 2]

Each of N client threads drives its own agent (OpenAI API, streamed, greedy,
64-token replies) for a few turns, all at once against one real server, which
decodes the agents together in one batch and interleaves their prefills. Three
rates: engine decode (tokens from batched decode steps over the time those
steps took, read from the server's /health counters), client decode (tokens
after each reply's first, over the time during which at least one reply was
streaming, prefill chunks interleaved) and overall (all output tokens over the
wall time). Because agents prefill their next turn while others decode, not
every step holds all N agents: "all N decoding" is the engine's rate over the
steps that did (from /health's ``by_batch``). TTFT includes any wait for a
place in the batch. Two servers run
side by side: ``split`` (the default: batched steps split over both cores,
``app/engine/cores.py``) and ``plain`` (``split_cores = false``); every level
of both is run ``--repeats`` times, interleaved, and medians are reported.
Prints a table, writes benchmarks/results/concurrency.json and concurrency.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import SYSTEM, user_message  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

REPLY_TOKENS = 64
SERVERS = {"split": "1", "plain": "0"}  # split_cores: batched steps over both cores, or OpenBLAS's threads


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    n_tokens: int
    decode_from: float  # perf_counter of the first token
    decode_to: float  # and of the end of the reply


def agent(url: str, name: str, turns: int) -> list[Turn]:
    rng = random.Random(name)
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for _ in range(turns):
        history.append({"role": "user", "content": user_message(rng, 150)})
        body = {"model": "m", "messages": history, "max_tokens": REPLY_TOKENS, "temperature": 0,
                "stream_options": {"include_usage": True}, "session_id": name}
        start = time.perf_counter()
        ttft, text, usage = openai_stream(f"{url}/v1/chat/completions", body)
        history.append({"role": "assistant", "content": text})
        out.append(Turn(ttft, usage.get("completion_tokens", 0), start + ttft, time.perf_counter()))
    return out


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one interval is open."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def measure(url: str, level: int, turns: int, prefix: str) -> dict:
    """``level`` agents at once against the server at ``url``: rates and TTFT percentiles."""
    before = httpx.get(f"{url}/health").json()["engine"]
    start = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        runs = list(pool.map(lambda i: agent(url, f"{prefix}-c{level}-{i}", turns), range(level)))
    wall = time.perf_counter() - start
    turns_ = [t for run in runs for t in run]
    ttfts = [t.ttft_s for t in turns_]
    tokens = sum(t.n_tokens for t in turns_)
    decoding = covered([(t.decode_from, t.decode_to) for t in turns_])
    after = httpx.get(f"{url}/health").json()["engine"]
    steps = after["decode_steps"] - before["decode_steps"]
    full = [(e["by_batch"].get(str(level), {"steps": 0, "s": 0.0})) for e in (before, after)]
    full_s = full[1]["s"] - full[0]["s"]
    return {"agents": level, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "engine_decode_tokens_per_s": (after["decode_tokens"] - before["decode_tokens"])
            / (after["decode_s"] - before["decode_s"]),
            "mean_batch": (after["decode_tokens"] - before["decode_tokens"]) / steps,
            "split_share": (after["split_steps"] - before["split_steps"]) / steps,
            # the steps in which all ``level`` agents decoded together
            "full_batch_share": (full[1]["steps"] - full[0]["steps"]) / steps,
            "full_batch_tokens_per_s": level * (full[1]["steps"] - full[0]["steps"]) / full_s if full_s else 0.0,
            "decode_tokens_per_s": sum(t.n_tokens - 1 for t in turns_) / decoding,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over every server and level; medians reported")
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    servers = {name: start_server(Path(tempfile.mkdtemp(prefix=f"semantic-concurrency-{name}-")), model_dir,
                                  {"SEMANTIC_SPLIT_CORES": flag})
               for name, flag in SERVERS.items()}
    measured: dict[tuple[str, int], list[dict]] = {}
    try:
        for repeat in range(args.repeats):  # interleaved, so the VM's drift hits every case alike
            for name, server in servers.items():
                for level in args.levels:
                    run = measure(server.url, level, args.turns, f"{name}{repeat}")
                    measured.setdefault((name, level), []).append(run)
                    print(f"{name} {level} agents: {run['engine_decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        for server in servers.values():
            stop_server(server)

    results = [{"server": name, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
               for (name, _), runs in measured.items()]
    for r in results:
        one = next(o for o in results if o["server"] == r["server"] and o["agents"] == 1)
        r["x_one_agent"] = r["engine_decode_tokens_per_s"] / one["engine_decode_tokens_per_s"]
        r["full_batch_x_one_agent"] = r["full_batch_tokens_per_s"] / one["engine_decode_tokens_per_s"]
    print_table(["server", "agents", "wall s", "engine decode tok/s", "x one agent", "mean batch",
                 "all N decoding: share of steps", "tok/s", "x one agent", "split steps", "client decode tok/s",
                 "overall tok/s", "TTFT p50 s", "TTFT p95 s"],
                [[r["server"], r["agents"], r["wall_s"], r["engine_decode_tokens_per_s"], r["x_one_agent"],
                  r["mean_batch"], r["full_batch_share"], r["full_batch_tokens_per_s"], r["full_batch_x_one_agent"],
                  r["split_share"], r["decode_tokens_per_s"], r["tokens_per_s"], r["ttft_p50_s"], r["ttft_p95_s"]]
                 for r in results])
    print(f"wrote {write_results('concurrency', {'args': vars(args), 'levels': results})}")
    plot(results)


def plot(results: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in SERVERS:
        rows = [r for r in results if r["server"] == name]
        levels = [r["agents"] for r in rows]
        style = {"linestyle": "-" if name == "split" else ":", "marker": "o"}
        for key, label, color in (("full_batch_tokens_per_s", "all N decoding", "C1"),
                                  ("engine_decode_tokens_per_s", "engine decode", "C0"),
                                  ("tokens_per_s", "overall (prefills included)", "C2")):
            left.plot(levels, [r[key] for r in rows], color=color, label=f"{label}, {name}", **style)
        for key, label, color in (("ttft_p50_s", "p50", "C0"), ("ttft_p95_s", "p95", "C3")):
            right.plot(levels, [r[key] for r in rows], color=color, label=f"{label}, {name}", **style)
    left.set_xlabel("concurrent agents")
    left.set_ylabel("aggregate tokens/s")
    left.legend(fontsize=7)
    right.set_xlabel("concurrent agents")
    right.set_ylabel("TTFT (s)")
    right.legend(fontsize=7)
    fig.suptitle("Concurrent agents, continuous batching, SmolLM2-135M, 2-core CPU (split solid, plain dotted)")
    save_plot(fig, "concurrency")


if __name__ == "__main__":
    main()
