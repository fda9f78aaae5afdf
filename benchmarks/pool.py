"""A local pool of 2 servers, agents routed by affinity against round-robin.

8 agents (each its own system prompt, so they share no prefix) run 6 turns each,
concurrently, through `semantic pool up --servers 2`. After turn 3, the server that holds
agent-0 is killed (-9); turns 4-6 show what a failover costs. Printed: per routing, the
share of each agent's turns on its usual server, the prompt tokens read from cache, and
the median seconds to the first token per turn. JSON and a plot in benchmarks/results/.

Then a failover alone, against a cold prefill of the same length: `semantic pool join`
adds a fresh server (one short request of another agent warms it up), the server holding
agent-0 is killed, and agent-0's next turn runs
alone (restored from the shared tier by whichever server the router now picks); then the same conversation with
one changed character at the start of its system prompt (so no cache matches) runs
alone: a cold prefill of as many tokens. The same for a longer conversation (~3.5K tokens)
built on the killed server before the kill.

    python -m benchmarks.pool [--agents 8] [--turns 6] [--kill-after 3]
    python -m benchmarks.pool --hosts 3 [--quick]   # a pool over hosts: benchmarks/pool_hosts.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from app.settings import load_settings
from benchmarks.common import RESULTS, anthropic_stream, print_table, pyplot, save_plot, write_results

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["plumbing", "gardening", "bicycles", "cameras", "tea", "chess", "sailing", "pottery",
          "astronomy", "baking", "knitting", "climbing"]


def system_prompt(agent: int) -> str:
    topic = TOPICS[agent % len(TOPICS)]
    return (f"You are agent {agent}, a shop assistant who knows everything about {topic}. "
            + f"Answer questions about {topic} briefly and politely, in one sentence. " * 40)


def stream_turn(router: str, agent: str, system: str, history: list[dict]) -> dict[str, Any]:
    """One streamed greedy turn: server, seconds to the first token, cached and total prompt tokens, reply."""
    body = {"model": "claude-sonnet-5", "max_tokens": 12, "temperature": 0, "system": system, "messages": history}
    answered: dict[str, str] = {}
    ttft, reply, usage = anthropic_stream(f"{router}/v1/messages", body, {"x-claude-code-session-id": agent}, answered)
    prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0) + usage.get(
        "cache_creation_input_tokens", 0)
    return {"server": answered.get("x-semantic-server", ""), "ttft_s": ttft,
            "cached": usage.get("cache_read_input_tokens", 0), "prompt": prompt, "reply": reply}


def run_pool(routing: str, n_agents: int, n_turns: int, kill_after: int, port: int) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"semantic-pool-bench-{routing}-"))
    (home / "models").symlink_to(load_settings().models_dir.resolve(), target_is_directory=True)
    env = {**os.environ, "SEMANTIC_HOME": str(home)}
    env.pop("SEMANTIC_DATABASE_URL", None)
    started = time.perf_counter()
    pool = subprocess.Popen([sys.executable, "-m", "app", "pool", "up", "--servers", "2", "--port", str(port),
                             "--routing", routing], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    state_path = home / "pool" / "state.json"
    try:
        while not state_path.exists():
            if pool.poll() is not None:
                raise RuntimeError(pool.stdout.read().decode() if pool.stdout else "pool up failed")
            time.sleep(0.3)
        state = json.loads(state_path.read_text())
        ready_s = time.perf_counter() - started
        print(f"[{routing}] pool ready in {ready_s:.1f} s", flush=True)
        histories: list[list[dict]] = [[] for _ in range(n_agents)]
        turns: list[list[dict[str, Any]]] = [[] for _ in range(n_agents)]
        killed: str | None = None
        for n in range(n_turns):
            if n == kill_after:
                killed = turns[0][-1]["server"]
                pid = next(s["pid"] for s in state["servers"] if s["id"] == killed)
                os.kill(pid, signal.SIGKILL)
                print(f"[{routing}] killed {killed} (pid {pid}) after turn {n}", flush=True)

            def one(agent: int) -> None:
                histories[agent].append({"role": "user", "content": f"Question {n + 1}: what should I buy first?"})
                result = stream_turn(state["router"], f"agent-{agent}", system_prompt(agent), histories[agent])
                histories[agent].append({"role": "assistant", "content": result["reply"] or "."})
                turns[agent].append(result)

            threads = [threading.Thread(target=one, args=(a,)) for a in range(n_agents)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            ttfts = [t[n]["ttft_s"] for t in turns]
            print(f"[{routing}] turn {n + 1}: median TTFT {statistics.median(ttfts):.2f} s, "
                  f"cached {sum(t[n]['cached'] for t in turns)}/{sum(t[n]['prompt'] for t in turns)} tokens",
                  flush=True)
        failover = failover_alone(home, state, turns[0][-1]["server"], histories[0], system_prompt(0), routing)
        return {"routing": routing, "ready_s": ready_s, "killed": killed, "kill_after": kill_after,
                "failover_alone": failover,
                "turns": [[{k: v for k, v in t.items() if k != "reply"} for t in agent] for agent in turns]}
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=120)
        postgres_dir = json.loads(state_path.read_text())["postgres_dir"] if state_path.exists() else None
        subprocess.run(["rm", "-rf", str(home), *([postgres_dir] if postgres_dir else [])], check=False)


def failover_alone(home: Path, state: dict[str, Any], holder: str, history: list[dict], system: str,
                   routing: str) -> dict[str, Any]:
    """agent-0's next turn after its server is killed, alone, against a cold prefill of the
    same length; the same for a longer conversation built on that server beforehand."""
    holder_url = next(s["url"] for s in state["servers"] if s["id"] == holder)
    long_system = system + " Here is the catalogue you know by heart. " + " ".join(
        f"Item {i}: a {TOPICS[i % len(TOPICS)]} kit, model {i * 7 % 97}, in stock." for i in range(220))
    long_history = [{"role": "user", "content": "What do you recommend for a beginner?"}]
    first = stream_turn(holder_url, "agent-long", long_system, long_history)
    long_history.append({"role": "assistant", "content": first["reply"] or "."})
    joined = subprocess.run([sys.executable, "-m", "app", "pool", "join"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "SEMANTIC_HOME": str(home)}, timeout=300)
    if joined.returncode != 0:
        raise RuntimeError(joined.stderr)
    servers = json.loads((home / "pool" / "state.json").read_text())["servers"]
    # Its first request pays the process's one-time costs; a failover should not be charged them.
    stream_turn(servers[-1]["url"], "warm-up", "You are brief.", [{"role": "user", "content": "Hello."}])
    os.kill(next(s["pid"] for s in servers if s["id"] == holder), signal.SIGKILL)
    probes = {}
    for name, agent, agent_system, agent_history, first in (("short", "agent-0", system, history, "X"),
                                                             ("long", "agent-long", long_system, long_history, "Z")):
        agent_history.append({"role": "user", "content": "One more question: what else do I need?"})
        restored = stream_turn(state["router"], agent, agent_system, agent_history)
        # Another first character (each probe its own: the long prompt starts as the short one does).
        cold = stream_turn(state["router"], f"{agent}-cold", first + agent_system[1:], agent_history)
        if cold["cached"]:
            raise RuntimeError(f"the cold prefill read {cold['cached']} tokens from cache")
        print(f"[{routing}] failover alone ({agent}) on {restored['server']}: {restored['ttft_s']:.2f} s to the "
              f"first token, {restored['cached']}/{restored['prompt']} tokens from cache; a cold prefill of "
              f"{cold['prompt']} tokens on {cold['server']}: {cold['ttft_s']:.2f} s "
              f"({cold['ttft_s'] / restored['ttft_s']:.1f}x)", flush=True)
        probes[name] = {"restored": {k: v for k, v in restored.items() if k != "reply"},
                        "cold": {k: v for k, v in cold.items() if k != "reply"}}
    return probes


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    turns, kill_after = run["turns"], run["kill_after"]
    before = [agent[:kill_after] for agent in turns]
    on_usual = sum(Counter(t["server"] for t in agent).most_common(1)[0][1] for agent in before)
    n_before = sum(len(agent) for agent in before)
    warm = [t for agent in turns for t in agent[1:kill_after]]  # turns 2..kill_after: the steady state
    after = [agent[kill_after] for agent in turns if len(agent) > kill_after]
    by_turn = [statistics.median(agent[n]["ttft_s"] for agent in turns) for n in range(len(turns[0]))]
    return {"routing": run["routing"], "same_server_share": on_usual / n_before,
            "steady_hit_rate": sum(t["cached"] for t in warm) / max(1, sum(t["prompt"] for t in warm)),
            "steady_median_ttft_s": statistics.median(t["ttft_s"] for t in warm),
            "first_turn_after_kill_hit_rate": sum(t["cached"] for t in after) / max(1, sum(t["prompt"] for t in after)),
            "median_ttft_by_turn_s": by_turn, "ready_s": run["ready_s"],
            "failover_alone": {name: {"prompt": probe["restored"]["prompt"],
                                      "hit_rate": probe["restored"]["cached"] / probe["restored"]["prompt"],
                                      "ttft_s": probe["restored"]["ttft_s"], "cold_ttft_s": probe["cold"]["ttft_s"],
                                      "speedup": probe["cold"]["ttft_s"] / probe["restored"]["ttft_s"]}
                               for name, probe in run["failover_alone"].items()}}


def main() -> None:
    if any(arg == "--hosts" or arg.startswith("--hosts=") for arg in sys.argv[1:]):
        # A pool over hosts (network namespaces): benchmarks/pool_hosts.py, its own flags.
        from benchmarks.pool_hosts import main as over_hosts

        over_hosts(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--port", type=int, default=38400)
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the saved JSON")
    args = parser.parse_args()
    if args.replot:
        replot()
        return
    runs = [run_pool(routing, args.agents, args.turns, args.kill_after, args.port + 10 * i)
            for i, routing in enumerate(("affinity", "round-robin"))]
    summaries = [summarise(run) for run in runs]
    print_table(["routing", "same server (turns 1-%d)" % args.kill_after, "hit rate, turns 2-%d" % args.kill_after,
                 "median TTFT s, turns 2-%d" % args.kill_after, "hit rate, turn after kill", "pool ready s"],
                [[s["routing"], f"{s['same_server_share']:.1%}", f"{s['steady_hit_rate']:.1%}",
                  s["steady_median_ttft_s"], f"{s['first_turn_after_kill_hit_rate']:.1%}", s["ready_s"]]
                 for s in summaries])
    print_table(["routing", "failover alone: prompt tokens", "read from the tier", "TTFT s", "cold prefill TTFT s",
                 "speed-up"],
                [[s["routing"], f["prompt"], f"{f['hit_rate']:.1%}", f["ttft_s"], f["cold_ttft_s"],
                  f"{f['speedup']:.1f}x"] for s in summaries for f in s["failover_alone"].values()])
    path = write_results("pool", {"agents": args.agents, "turns": args.turns, "summaries": summaries, "runs": runs})
    print(f"wrote {path}")
    plot(summaries, args.agents, args.turns, args.kill_after)


def plot(summaries: list[dict[str, Any]], n_agents: int, n_turns: int, kill_after: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in summaries:
        ax.plot(range(1, n_turns + 1), s["median_ttft_by_turn_s"], marker="o", label=s["routing"])
    ax.axvline(kill_after + 0.5, color="grey", linestyle="--", label="kill -9 of one server")
    ax.set_xlabel("turn")
    ax.set_ylabel("median seconds to first token")
    ax.set_title(f"{n_agents} agents on a local pool of 2 servers")
    ax.legend()
    save_plot(fig, "pool")


def replot() -> None:
    """Redraw the plot from benchmarks/results/pool.json."""
    data = json.loads((RESULTS / "pool.json").read_text())
    plot(data["summaries"], data["agents"], data["turns"], data["runs"][0]["kill_after"])

if __name__ == "__main__":
    main()
