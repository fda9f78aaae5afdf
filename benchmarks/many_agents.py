"""Workload 3: many agents interleaved round-robin under a memory budget that holds only some hot.

    .venv/bin/python benchmarks/many_agents.py [--agents 8] [--rounds 4] [--hot 3]

N agents each build a conversation of ~1K tokens, then take turns round-robin.
The server's ``cache_memory_bytes`` is set so about ``--hot`` agents fit in
memory: the others spill to disk and are read back on their turn. The same
rounds on a server with a budget that holds every agent, and on one with reuse
off, give the hot and the cold TTFT. Prints a table, writes
benchmarks/results/many_agents.json and many_agents.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import SYSTEM, user_message  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

BYTES_PER_TOKEN = 6480  # SmolLM2's 4-bit KV bytes per token (benchmarks/memory.py)
WORKING_BYTES_PER_TOKEN = 46080  # its float32 working copy (keys and values, 30 layers)


def stream_turn(url: str, agent: str, messages: list[dict]) -> tuple[float, str]:
    """(seconds to the first content delta, reply text) of one streamed turn of ``agent``."""
    body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0, "session_id": agent}
    ttft, text, _ = openai_stream(f"{url}/v1/chat/completions", body)
    return ttft, text


def rounds(url: str, args: argparse.Namespace) -> list[list[float]]:
    """TTFT per round per agent; every server sees the same messages."""
    rng = random.Random(11)
    histories = {f"agent-{i}": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": user_message(rng, args.context_words)}]
                 for i in range(args.agents)}
    for agent, history in histories.items():  # build each conversation once
        history.append({"role": "assistant", "content": stream_turn(url, agent, history)[1]})
    table = []
    for _ in range(args.rounds):
        row = []
        for agent, history in histories.items():
            history.append({"role": "user", "content": user_message(rng, 40)})
            ttft, reply = stream_turn(url, agent, history)
            history.append({"role": "assistant", "content": reply})
            row.append(ttft)
        table.append(row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hot", type=int, default=3, help="agents the small budget holds")
    parser.add_argument("--context-words", type=int, default=800)
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    scratch = Path(tempfile.mkdtemp(prefix="semantic-many-"))
    agent_bytes = int(args.context_words * 1.3 * BYTES_PER_TOKEN)
    # The budget also holds the float working copy a turn runs on (admission refuses a
    # request whose working copy alone exceeds it): the longest turn's prompt and reply.
    working = int((args.context_words * 1.3 + args.rounds * 60 + 64) * WORKING_BYTES_PER_TOKEN)
    configs = {
        "all hot": {"SEMANTIC_CACHE_MEMORY_BYTES": str(agent_bytes * args.agents * 4 + working)},
        f"budget for {args.hot}": {"SEMANTIC_CACHE_MEMORY_BYTES": str(agent_bytes * args.hot + working)},
        "reuse off": {"SEMANTIC_CACHE_REUSE": "0"},
    }
    results = {}
    for name, env in configs.items():
        server = start_server(scratch / name.replace(" ", "-"), model_dir, env)
        try:
            results[name] = {"env": env, "ttft_s": rounds(server.url, args),
                             "evictions": server.log().count("spilled to disk")}
        finally:
            stop_server(server)

    rows = [[name, statistics.median(t for row in r["ttft_s"] for t in row),
             max(t for row in r["ttft_s"] for t in row), r["evictions"]] for name, r in results.items()]
    print_table(["server", "median TTFT s", "max TTFT s", "spills to disk"], rows)
    print(f"wrote {write_results('many_agents', {'args': vars(args), 'configs': results})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, r in results.items():
        ax.plot([t for row in r["ttft_s"] for t in row], ".-", label=name)
    ax.set_xlabel(f"turn ({args.agents} agents round-robin, {args.rounds} rounds)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Many agents under a memory budget, SmolLM2-135M, 2-core CPU")
    save_plot(fig, "many_agents")


if __name__ == "__main__":
    main()
