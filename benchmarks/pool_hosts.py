"""A pool over hosts: `python -m benchmarks.pool --hosts 3` (Linux network namespaces, root).

The pool of tests/support/pool_hosts.py: PostgreSQL, the S3 tier (SeaweedFS) and the
worker on a store host, HAProxy on a router host, `semantic serve --host 0.0.0.0
--no-worker` (SmolLM2, an API key) on each of N server hosts, one more host idle. 24
agents (each its own ~1K-token system prompt) run 6 turns through the router: OpenAI
chat, streamed, greedy, 16-token replies, the agent named by ``x-session-id`` (the
header the router keys on); the agents of a turn go one after another, so each TTFT is a
turn's own, not a queue's. A 503 (or 502/504, or a refused connection) is retried after
its ``retry-after`` (1 s without one), up to 10 times. After turn 3 one server host fails
(every process of its namespace SIGKILLed, its link cut); after turn 4 the idle host runs
`semantic pool join --router`, and new agents are sent until one lands on it.

Per turn: turns served, retries, cached tokens / the agent's previous prompt (over 100%
when the previous reply's tokens are cached too), TTFT (median, p90), and cold prefills of
the same size, each alone: fresh agents with agents 0-2's messages of that turn and
other first characters of the system prompt, a pair per probe (no cache matches, not even
an earlier probe's, so every token is computed), their median. Ownership from the store's ``owners`` table before
the kill, after the first turn after it and at the end (server and epoch per agent); the
history check: every message the client saw committed is in the store at the end.
Table, JSON and PNG in benchmarks/results/ (pool_hosts.*; --quick: 6 agents x 4 turns with
~280-token system prompts, the kill after turn 2 and the join after 3, printed only).

    python -m benchmarks.pool --hosts 3 [--agents 24] [--turns 6] [--kill-after 3] [--join-after 4] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.pool_hosts import KEY, PoolHosts, messages_per_agent, missing

from benchmarks.common import (
    RESULTS,
    device,
    openai_stream_timed,
    print_table,
    pyplot,
    save_plot,
    write_results,
)
from benchmarks.pool import TOPICS

RETRIES = 10
RETRIED = {502, 503, 504}
COLD_PROBES = 3  # cold prefills a turn (agents 0-2's sizes), their median reported
COLD_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXZ"


def system_prompt(agent: int, repeats: int) -> str:
    topic = TOPICS[agent % len(TOPICS)]
    return (f"You are agent {agent}, a shop assistant who knows everything about {topic}. "
            + f"Answer questions about {topic} briefly and politely, in one sentence. " * repeats)


def chat(router: str, agent: str, messages: list[dict]) -> dict[str, Any]:
    """One streamed greedy chat turn through the router, retried on 502/503/504 and refused
    connections: server, status, retries, TTFT of the served try, seconds from the first
    try to the first token, cached and prompt tokens, reply."""
    body = {"model": "gpt-5", "max_tokens": 16, "temperature": 0, "messages": messages,
            "stream_options": {"include_usage": True}}
    headers = {"x-session-id": agent, "authorization": f"Bearer {KEY}"}
    start = time.perf_counter()
    for retries in range(RETRIES + 1):
        answered: dict[str, str] = {}
        tried = time.perf_counter()
        try:
            times = openai_stream_timed(f"{router}/v1/chat/completions", body, headers, answered)
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in RETRIED:
                raise
            time.sleep(float(error.response.headers.get("retry-after", 1)))
            continue
        except httpx.TransportError:
            time.sleep(1)
            continue
        usage = times.usage
        return {"server": answered.get("x-semantic-server", ""), "served": True, "retries": retries,
                "ttft_s": times.ttft_s, "wait_s": tried - start + times.ttft_s,
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "prompt": usage.get("prompt_tokens", 0), "reply": times.text}
    return {"server": "", "served": False, "retries": RETRIES, "ttft_s": None, "wait_s": time.perf_counter() - start,
            "cached": 0, "prompt": 0, "reply": ""}


def summarise(turns: list[list[dict[str, Any]]], cold: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per turn (``turns[agent][n]``, each with its agent's previous prompt as ``previous``):
    turns served, retries, the share of the previous prompts read from cache (all of them,
    and the agent-turn with the least), TTFT median and p90, the cold prefill beside it."""
    rows = []
    for n in range(max(len(agent) for agent in turns)):
        these = [agent[n] for agent in turns if len(agent) > n]
        served = [t for t in these if t["served"]]
        ttfts = sorted(t["ttft_s"] for t in served)
        warm = [t for t in served if t.get("previous")]
        median = statistics.median(ttfts) if ttfts else None
        rows.append({
            "turn": n + 1, "agents": len(these), "served": len(served), "retries": sum(t["retries"] for t in these),
            "servers": sorted({t["server"] for t in served}),
            "cache_read": sum(t["cached"] for t in warm) / sum(t["previous"] for t in warm) if warm else None,
            "min_cache_read": min(t["cached"] / t["previous"] for t in warm) if warm else None,
            "ttft_median_s": median, "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "cold_prompt": cold[n]["prompt"], "cold_ttft_s": cold[n]["ttft_s"],
            "speedup": cold[n]["ttft_s"] / median if median and cold[n]["ttft_s"] else None})
    return rows


def ownership(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]],
              served_by: dict[str, list[str]]) -> dict[str, Any]:
    """Owners (server, epoch) at two times and the servers that answered each agent's turns
    between: the agents whose owner changed, and whether every change of the answering
    server came with a later epoch (each move a takeover, never two owners at once)."""
    changed = sorted(a for a in after if a in before and after[a][0] != before[a][0])
    moves = {a: sum(1 for x, y in itertools.pairwise(s) if x != y) for a, s in served_by.items()}
    epochs_ok = all(after[a][1] - before.get(a, ("", 0))[1] >= moves[a] for a in moves if a in after) and all(
        after[a][0] == s[-1] for a, s in served_by.items() if a in after and s)
    return {"changed": len(changed), "agents": changed, "moves": sum(moves.values()), "epochs_consistent": epochs_ok}


def goals(rows: list[dict[str, Any]], turns: list[list[dict[str, Any]]], kill_after: int, history_ok: bool,
          owners_ok: bool, join_s: float | None) -> dict[str, dict[str, Any]]:
    """The issue's goals, each with its value and whether it was met (reported, not asserted)."""
    total = sum(row["agents"] for row in rows)
    served = sum(row["served"] for row in rows)
    after = [t for agent in turns for t in agent[kill_after:] if t["served"] and t.get("previous")]
    least = min((t["cached"] / t["previous"] for t in after), default=None)
    first_after = rows[kill_after] if len(rows) > kill_after else None
    speedup = first_after["speedup"] if first_after else None
    return {"turns served (>= 99%)": {"value": served / total, "met": served / total >= 0.99},
            "committed history in the store (100%)": {"value": history_ok, "met": history_ok},
            "previous prompt read from cache after the failure (>= 90%, least agent-turn)":
                {"value": least, "met": least is not None and least >= 0.9},
            "first turn after the failure against a cold prefill (>= 5x)":
                {"value": speedup, "met": speedup is not None and speedup >= 5},
            "no agent on two servers at once (epochs)": {"value": owners_ok, "met": owners_ok},
            "pool join serves its first agent (< 60 s)": {"value": join_s, "met": join_s is not None and join_s < 60}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from app.catalog.registry import ensure_embedded
    from app.engine.model import ensure_calibrated
    from app.settings import load_settings

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct", progress=False)
    ensure_calibrated(model_dir.name, model_dir)
    scratch = Path(tempfile.mkdtemp(prefix="semantic-pool-hosts-bench-"))
    try:
        return over_hosts(args, model_dir, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def over_hosts(args: argparse.Namespace, model_dir: Path, scratch: Path) -> dict[str, Any]:
    servers = [f"h{i + 1}" for i in range(args.hosts)]
    joiner = f"h{args.hosts + 1}"
    started = time.perf_counter()
    with PoolHosts(scratch, model_dir, servers, later=[joiner]) as pool:
        print(f"pool of {args.hosts} hosts ready in {time.perf_counter() - started:.1f} s", flush=True)
        names = [f"agent-{a}" for a in range(args.agents)]
        systems = [system_prompt(a, args.repeats) for a in range(args.agents)]
        histories: list[list[dict]] = [[{"role": "system", "content": s}] for s in systems]
        turns: list[list[dict[str, Any]]] = [[] for _ in names]
        cold: list[dict[str, Any]] = []
        owners: dict[str, Any] = {}
        killed, join = None, None
        for n in range(args.turns):
            if n == args.kill_after:
                owners["before_kill"] = pool.owners()
                killed = max(servers, key=lambda s: sum(1 for t in turns if t[-1]["server"] == s))
                pool.kill(killed)
                print(f"killed every process of host {killed} (its link cut) after turn {n}", flush=True)
            if n == args.join_after:
                join = join_host(pool, joiner, histories[0][0]["content"])
            for a, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {n + 1}: what should I buy first, and why?"})
                result = chat(pool.router, names[a], history)
                result["previous"] = turns[a][-1]["prompt"] if turns[a] else 0
                if result["served"]:
                    history.append({"role": "assistant", "content": result["reply"]})
                else:
                    history.pop()
                turns[a].append(result)
            cold.append(cold_prefill(pool.router, n, histories[:COLD_PROBES]))
            row = summarise(turns, cold)[-1]
            print(f"turn {n + 1}: served {row['served']}/{row['agents']}, retries {row['retries']}, "
                  f"cache read {fmt(row['cache_read'])}, median TTFT {row['ttft_median_s']:.2f} s, "
                  f"cold {row['cold_prompt']} tokens {row['cold_ttft_s']:.2f} s", flush=True)
            if n == args.kill_after:
                owners["after_kill"] = pool.owners()
        owners["end"] = pool.owners()
        stored = messages_per_agent(pool.database_url)
    expected = {names[a]: len(h) for a, h in enumerate(histories)}  # the system prompt, each user turn and reply
    missing_history = {a: (stored.get(a, 0), n) for a, n in expected.items() if stored.get(a, 0) != n}
    served_by = {names[a]: [t["server"] for t in turns[a][args.kill_after - 1:] if t["served"]]
                 for a in range(len(names))}
    bench = set(names)
    moved = ownership({a: o for a, o in owners["before_kill"].items() if a in bench},
                      {a: o for a, o in owners["end"].items() if a in bench}, served_by)
    rows = summarise(turns, cold)
    return {"killed": killed, "join": join, "owners": owners, "ownership": moved, "rows": rows,
            "history": {"expected_messages": sum(expected.values()), "stored_messages": sum(
                stored.get(a, 0) for a in expected), "short": missing_history},
            "goals": goals(rows, turns, args.kill_after, not missing_history, moved["epochs_consistent"],
                           join["first_served_s"] if join else None),
            "turns": [[{k: v for k, v in t.items() if k != "reply"} for t in agent] for agent in turns],
            "cold": cold}


def cold_system(system: str, k: int) -> str:
    """``system`` with its first two characters replaced by the ``k``-th pair of capitals
    without Y (the agents' prompts start "You"): the first token differs from every agent's
    and every other probe's, so no cache matches, not even an earlier probe's (the next
    turn's probe extends its messages)."""
    return COLD_LETTERS[k % len(COLD_LETTERS)] + COLD_LETTERS[k // len(COLD_LETTERS) % len(COLD_LETTERS)] + system[2:]


def cold_prefill(router: str, n: int, histories: list[list[dict]]) -> dict[str, Any]:
    """Cold prefills of turn ``n``'s size, one at a time: each agent's messages of the turn
    as a fresh agent's, the system prompt's first characters changed (``cold_system``);
    the medians of their prompt tokens and TTFTs."""
    probes = []
    for a, history in enumerate(histories):
        messages = history if history[-1]["role"] == "user" else history[:-1]
        system = cold_system(history[0]["content"], n * len(histories) + a)
        probe = chat(router, f"cold-{n + 1}-{a}", [{"role": "system", "content": system}, *messages[1:]])
        if probe["cached"]:
            print(f"  cold probe {n + 1}-{a} read {probe['cached']} tokens from cache", flush=True)
        probes.append({k: v for k, v in probe.items() if k != "reply"})
    served = [p for p in probes if p["served"]]
    return {"prompt": statistics.median(p["prompt"] for p in served) if served else 0,
            "ttft_s": statistics.median(p["ttft_s"] for p in served) if served else None,
            "cached": max((p["cached"] for p in served), default=0), "probes": probes}


def join_host(pool: PoolHosts, name: str, system: str) -> dict[str, Any]:
    """``pool join --router`` on host ``name``, then new agents until one is served there:
    the seconds from the join's start to that agent's first token."""
    started = time.perf_counter()
    joined = pool.join(name)
    if joined.returncode != 0:
        raise RuntimeError(joined.stdout + joined.stderr)
    join_s = time.perf_counter() - started
    for i in range(8):
        result = chat(pool.router, f"new-{i}", [{"role": "system", "content": system},
                                                {"role": "user", "content": "Do you sell paint?"}])
        if result["server"] == name:
            first = time.perf_counter() - started
            print(f"host {name} joined in {join_s:.1f} s; new-{i} served there {first:.1f} s after the join began",
                  flush=True)
            return {"host": name, "join_s": join_s, "first_served_s": first, "newcomers": i + 1}
    print(f"host {name} joined in {join_s:.1f} s; no new agent of 8 landed on it", flush=True)
    return {"host": name, "join_s": join_s, "first_served_s": None, "newcomers": 8}


def fmt(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=3, help="server hosts at the start")
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--join-after", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=80,
                        help="sentences in each system prompt (80: ~1K tokens)")
    parser.add_argument("--quick", action="store_true", help="6 agents x 4 turns, ~280-token system prompts (a smoke run)")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the saved JSON")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((RESULTS / "pool_hosts.json").read_text())
        plot("pool_hosts", saved, argparse.Namespace(**saved["args"]), saved["device"])
        return
    if args.quick:
        args.agents, args.turns, args.kill_after, args.join_after, args.repeats = 6, 4, 2, 3, 20
    reason = missing()
    if reason:
        raise SystemExit(f"a pool over hosts cannot run here: {reason}")
    where = device()
    result = run(args)
    report(result)
    if args.quick:  # a smoke run: printed only (as pool_sim's)
        return
    path = write_results("pool_hosts", {"args": vars(args), "device": where, **result})
    print(f"wrote {path}")
    plot("pool_hosts", result, args, where)


def report(result: dict[str, Any]) -> None:
    print_table(["turn", "served", "retries", "servers", "cache read", "least", "TTFT median s", "p90 s",
                 "cold prompt", "cold TTFT s", "speed-up"],
                [[r["turn"], f"{r['served']}/{r['agents']}", r["retries"], " ".join(r["servers"]), fmt(r["cache_read"]),
                  fmt(r["min_cache_read"]), r["ttft_median_s"], r["ttft_p90_s"], r["cold_prompt"], r["cold_ttft_s"],
                  "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"] for r in result["rows"]])
    moved, history = result["ownership"], result["history"]
    print(f"killed {result['killed']}; ownership: {moved['changed']} agents changed owner, {moved['moves']} moves, "
          f"epochs consistent: {moved['epochs_consistent']}; history: {history['stored_messages']}/"
          f"{history['expected_messages']} messages in the store")
    before, end = result["owners"]["before_kill"], result["owners"]["end"]
    for agent in moved["agents"]:
        print(f"  {agent}: {before[agent][0]} at epoch {before[agent][1]} -> {end[agent][0]} at epoch {end[agent][1]}")
    for goal, verdict in result["goals"].items():
        value = verdict["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {'met' if verdict['met'] else 'NOT met'}: {goal}: {shown}")


def plot(name: str, result: dict[str, Any], args: argparse.Namespace, where: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    x = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["ttft_median_s"] for r in rows], marker="o", label="median TTFT, through the pool")
    ax.plot(x, [r["cold_ttft_s"] for r in rows], marker="s", linestyle=":", label="cold prefill, same size")
    ax.axvline(args.kill_after + 0.5, color="red", linestyle="--", label=f"host {result['killed']} killed")
    ax.axvline(args.join_after + 0.5, color="green", linestyle="--", label="pool join")
    ax.set_xlabel("turn")
    ax.set_ylabel("seconds to first token")
    share = ax.twinx()
    share.plot(x[1:], [r["cache_read"] for r in rows[1:]], color="grey", marker=".", label="previous prompt from cache")
    share.set_ylim(0, 1.05)
    share.set_ylabel("share of the previous prompt read from cache")
    ax.set_title(f"{args.agents} agents, {args.hosts} hosts (namespaces), {where['name']}", fontsize=9)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = share.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=7, loc="lower right", bbox_to_anchor=(1, 0.12))
    save_plot(fig, name)


if __name__ == "__main__":
    main()
