"""Workload 3: the direct agent API's system-prompt prefill makes the first turn warm.

    .venv/bin/python benchmarks/agent_prefill.py [--sizes 500 1000 2000 4000]

For each system prompt size, two agents with different (random) system prompts
of that size are created on a real server: one with ``prefill`` (the default:
the 201 returns once the system prompt is cached), one without. Each then
takes its first turn, streamed; the client measures the time to the first
token. Prints a table, writes benchmarks/results/agent_prefill.json and
agent_prefill.png.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import anthropic_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import user_message  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

QUESTION = [{"role": "user", "content": "In one sentence: what is your job?"}]


def first_turn(url: str, agent: str) -> tuple[float, dict]:
    """(seconds to the first text delta, usage) of the agent's first streamed turn."""
    ttft, _, usage = anthropic_stream(f"{url}/v1/agents/{agent}/generate",
                                      {"messages": QUESTION, "max_tokens": 8, "temperature": 0})
    return ttft, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 4000],
                        help="approximate system prompt sizes in words")
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    rng = random.Random(3)
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-prefill-")), model_dir)
    results = []
    try:
        api = httpx.Client(base_url=server.url, timeout=900)
        for size in args.sizes:
            row: dict = {"words": size}
            for mode, prefill in (("prefilled", True), ("plain", False)):
                agent = f"{mode}-{size}"
                start = time.perf_counter()
                created = api.post("/v1/agents", json={"id": agent, "system_prompt": user_message(rng, size),
                                                       "prefill": prefill})
                created.raise_for_status()
                row[f"{mode}_create_s"] = time.perf_counter() - start
                ttft, usage = first_turn(server.url, agent)
                row[f"{mode}_ttft_s"] = ttft
                row[f"{mode}_cached"] = usage["cache_read_input_tokens"]
                row["prompt_tokens"] = sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens",
                                                              "cache_creation_input_tokens"))
            results.append(row)
    finally:
        stop_server(server)

    print_table(["prompt tokens", "create+prefill s", "first TTFT prefilled s", "cached", "create s",
                 "first TTFT plain s", "plain/prefilled"],
                [[r["prompt_tokens"], r["prefilled_create_s"], r["prefilled_ttft_s"], r["prefilled_cached"],
                  r["plain_create_s"], r["plain_ttft_s"], r["plain_ttft_s"] / r["prefilled_ttft_s"]] for r in results])
    print(f"wrote {write_results('agent_prefill', {'args': vars(args), 'sizes': results})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    tokens = [r["prompt_tokens"] for r in results]
    ax.plot(tokens, [r["plain_ttft_s"] for r in results], "o-", label="first turn, no prefill")
    ax.plot(tokens, [r["prefilled_ttft_s"] for r in results], "o-", label="first turn after prefill")
    ax.set_xlabel("first prompt (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.legend()
    ax.set_title("Direct agent API: system prompt prefill, SmolLM2-135M, 2-core CPU")
    save_plot(fig, "agent_prefill")


if __name__ == "__main__":
    main()
