"""Workload 2: agents with long contexts survive a server restart.

    .venv/bin/python benchmarks/restart.py [--agents 3] [--context 2000]

N agents build long conversations on a real server. Each then takes one more
turn while hot (in memory), the server is killed with SIGKILL and restarted,
and each takes another turn: its cache comes from disk. The same turn on a
server with reuse off gives the re-prefill time. TTFT is measured by the
client over HTTP. Prints a table, writes benchmarks/results/restart.json and
restart.png.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import stream_ttft, user_message  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402
from support.dbcheck import wait_persisted  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--context", type=int, default=2000, help="approximate tokens per agent")
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    rng = random.Random(1)
    home = Path(tempfile.mkdtemp(prefix="semantic-restart-"))
    histories: dict[str, list[dict]] = {}
    results: dict[str, dict] = {}
    server = start_server(home / "warm", model_dir)
    try:
        for i in range(args.agents):
            agent = f"agent-{i}"
            history = [{"role": "user", "content": user_message(rng, int(args.context * 0.7))}]
            _, reply, usage = stream_ttft(server.url, agent, history, 16)
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": user_message(rng, 30)}]
            hot_ttft, reply, usage = stream_ttft(server.url, agent, history, 16)
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": user_message(rng, 30)}]
            histories[agent] = history
            results[agent] = {"context": usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"],
                              "hot_s": hot_ttft, "hot_new": usage["cache_creation_input_tokens"]}
            wait_persisted(server.db_path, agent, results[agent]["context"])
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        print("killed the server with SIGKILL; restarting", file=sys.stderr)
        server = start_server(home / "warm", model_dir)
        for agent, history in histories.items():
            ttft, _, usage = stream_ttft(server.url, agent, history, 16)
            results[agent].update(restart_s=ttft, restart_reused=usage["cache_read_input_tokens"],
                                  restart_new=usage["cache_creation_input_tokens"])
    finally:
        stop_server(server)
    cold = start_server(home / "cold", model_dir, {"SEMANTIC_CACHE_REUSE": "0"})
    try:
        for agent, history in histories.items():
            results[agent]["cold_s"] = stream_ttft(cold.url, agent, history, 16)[0]
    finally:
        stop_server(cold)

    rows = [[agent, r["context"], r["hot_new"], r["hot_s"], r["restart_new"], r["restart_s"], r["cold_s"],
             r["restart_s"] / r["hot_s"], r["cold_s"] / r["restart_s"]] for agent, r in results.items()]
    print_table(["agent", "context", "hot new", "hot s", "restart new", "restart s", "re-prefill s",
                 "restart/hot", "re-prefill/restart"], rows)
    print(f"wrote {write_results('restart', {'args': vars(args), 'agents': results})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(results)
    for offset, (key, label) in enumerate((("hot_s", "hot (in memory)"), ("restart_s", "after SIGKILL + restart (disk)"),
                                           ("cold_s", "re-prefill (reuse off)"))):
        ax.bar([i + offset * 0.27 for i in range(len(names))], [results[n][key] for n in names], width=0.27, label=label)
    ax.set_xticks([i + 0.27 for i in range(len(names))], names)
    ax.set_ylabel("time to first token (s)")
    ax.legend()
    ax.set_title("First turn after a restart, SmolLM2-135M, 2-core CPU")
    save_plot(fig, "restart")


if __name__ == "__main__":
    main()
