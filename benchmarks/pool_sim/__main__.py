"""A discrete-event simulation of Semantic's pool mode at internet scale.

1,000 servers and 100,000 agents by default: agents arrive over two simulated hours, each
with one of 20 shared system prompts, and take 4-14 turns that grow their conversation;
each server has the default cache budgets (2 GiB of memory, 20 GiB of disk) and one
queue. Each routing policy serves the same agents twice: with no failures, and with 5% of
the servers killed (their memory and disk lost; back empty 10 minutes later) and 5% more
joining, during the middle half of the arrivals. Costs come from numbers measured on this
machine (benchmarks/results/; each one's file is printed). Printed: the share of prompt
tokens read from cache and TTFT percentiles per policy, beside llm-d's published p90 TTFT.
JSON and a plot in benchmarks/results/pool_sim.*.

    python -m benchmarks.pool_sim [--servers 1000] [--agents 100000] [--quick] [--seed 0]
    python -m benchmarks.pool_sim --calibrate [--calibrate-prefill]   # measure the S3 tier here first
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from app.settings import Settings
from benchmarks.common import RESULTS, print_table, pyplot, save_plot, write_results
from benchmarks.pool_sim.costs import describe, kv_bytes_per_token, load_costs, with_s3
from benchmarks.pool_sim.routers import Affinity, PrefixAware, Random, Router
from benchmarks.pool_sim.sim import Faults, Pool, memory_tokens, simulate
from benchmarks.pool_sim.workload import Workload, make_plan

# llm-d, "KV-Cache Wins You Can See" (2025-09-24, https://llm-d.ai/blog/kvcache-wins-you-can-see):
# 8 vLLM pods x 2 H100 (16 GPUs), Qwen3-32B, a multi-tenant workload with shared prefixes.
LLM_D_P90_TTFT_S = {"precise prefix-cache aware": 0.542, "approximate prefix-cache aware": 31.083,
                    "random": 92.551}
POLICIES = {
    "affinity": lambda args: Affinity(tier=True, placement=args.placement, balance=args.balance),
    "affinity-no-tier": lambda args: Affinity(tier=False, placement=args.placement, balance=args.balance),
    "prefix": lambda args: PrefixAware(),
    "random": lambda args: Random(tier=False),
    "random-tier": lambda args: Random(tier=True),
}
LLM_D_MATCH = {"prefix": "precise prefix-cache aware", "random": "random"}


def setting_default(name: str) -> Any:
    return Settings.model_fields[name].default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true",
                        help="20 servers, 2,000 agents (the same load per server); prints, writes no results")
    parser.add_argument("--hours", type=float, default=2.0, help="the window over which agents arrive")
    parser.add_argument("--think-s", type=float, default=30.0, help="mean pause between turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    parser.add_argument("--placement", choices=("least", "hash"), default="least",
                        help="affinity's placement of new and moved agents")
    parser.add_argument("--balance", type=float, default=1.25, help="the bound of --placement hash, x the mean")
    parser.add_argument("--kill-fraction", type=float, default=0.05)
    parser.add_argument("--join-fraction", type=float, default=0.05)
    parser.add_argument("--rejoin-s", type=float, default=600.0)
    parser.add_argument("--memory-bytes", type=int, default=setting_default("cache_memory_bytes"))
    parser.add_argument("--disk-bytes", type=int, default=setting_default("disk_budget_bytes"))
    parser.add_argument("--s3-latency-ms", type=float, help="instead of the measured loopback latency")
    parser.add_argument("--s3-mb-per-s", type=float, help="instead of the measured loopback bandwidth")
    parser.add_argument("--calibrate", action="store_true", help="measure the S3 tier here first (moto)")
    parser.add_argument("--calibrate-prefill", action="store_true", help="and the engine's prefill (loads SmolLM2)")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the saved JSON")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "pool_sim.json").read_text()))
        return
    if args.quick:
        args.servers, args.agents = 20, 2000
    if args.calibrate or args.calibrate_prefill:
        from benchmarks.pool_sim.calibrate import calibrate

        calibrate(RESULTS, kv_bytes_per_token(RESULTS)[0], args.calibrate_prefill)
    costs = with_s3(load_costs(RESULTS), None if args.s3_latency_ms is None else args.s3_latency_ms / 1000,
                    None if args.s3_mb_per_s is None else args.s3_mb_per_s * 1e6)
    print_table(["cost", "value", "from"], describe(costs))
    workload = Workload(agents=args.agents, arrival_s=args.hours * 3600, think_s=args.think_s)
    pool = Pool(servers=args.servers, memory_tokens=memory_tokens(args.memory_bytes, costs),
                disk_tokens=memory_tokens(args.disk_bytes, costs))
    scenarios = {"steady": Faults(),
                 "failures": Faults(kill_fraction=args.kill_fraction, join_fraction=args.join_fraction,
                                    rejoin_s=args.rejoin_s)}
    plan = make_plan(workload, args.seed)
    print(f"{args.agents} agents, {plan.n_turns} turns, {args.servers} servers "
          f"({pool.memory_tokens} tokens of memory, {pool.disk_tokens} of disk each)", flush=True)
    runs = []
    for key in args.policies.split(","):
        for scenario, faults in scenarios.items():
            router: Router = POLICIES[key](args)
            started = time.perf_counter()
            result = simulate(plan, pool, faults, router, costs, seed=args.seed)
            runs.append({"key": key, "scenario": scenario, **result.summary(),
                         "wall_s": time.perf_counter() - started})
            print(f"[{runs[-1]['wall_s']:.1f} s] {router.name}, {scenario}: hit {result.hit_rate:.1%}, "
                  f"TTFT p50 {runs[-1]['ttft_p50_s']:.2f} s, p99 {runs[-1]['ttft_p99_s']:.2f} s", flush=True)
    print_table(["policy", "servers", "hit rate", "ideal", "from tier", "TTFT p50 s", "p90 s", "p99 s",
                 "failover turns", "their hit rate", "their TTFT p50 s", "utilization"],
                [[r["policy"], r["scenario"], f"{r['hit_rate']:.1%}", f"{r['ideal_hit_rate']:.1%}",
                  f"{r['from_tier']:.1%}", r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p99_s"], r["failover_turns"],
                  "-" if r["failover_hit_rate"] is None else f"{r['failover_hit_rate']:.1%}",
                  "-" if r["failover_ttft_p50_s"] is None else r["failover_ttft_p50_s"], f"{r['utilization']:.0%}"]
                 for r in runs])
    print()
    print_table(["llm-d (16 H100, Qwen3-32B)", "its p90 TTFT s", "here (SmolLM2, 2-core CPU costs)",
                 "p90 s, steady", "p90 s, failures"], llm_d_rows(runs))
    print("Caveat: llm-d's numbers are its own workload on 16 H100 GPUs serving Qwen3-32B; these are a simulation "
          "of this 2-core CPU serving SmolLM2-135M, so compare each side's ratios, not seconds.")
    if args.quick:
        return
    path = write_results("pool_sim", {
        "args": vars(args), "workload": dataclasses.asdict(workload), "pool": dataclasses.asdict(pool),
        "faults": {name: dataclasses.asdict(f) for name, f in scenarios.items()},
        "costs": {**{k: v for k, v in dataclasses.asdict(costs).items() if k != "sources"}, "sources": costs.sources},
        "llm_d_p90_ttft_s": LLM_D_P90_TTFT_S, "runs": runs})
    print(f"wrote {path}")
    plot(json.loads(Path(path).read_text()))


def llm_d_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    p90 = {(r["key"], r["scenario"]): r["ttft_p90_s"] for r in runs}
    rows = []
    for label, seconds in LLM_D_P90_TTFT_S.items():
        key = next((k for k, v in LLM_D_MATCH.items() if v == label), None)
        rows.append([label, seconds, key or "not simulated", p90.get((key, "steady"), "-"),
                     p90.get((key, "failures"), "-")])
    for key in ("affinity", "affinity-no-tier"):
        if (key, "steady") in p90:
            rows.append(["(no counterpart)", "-", key, p90[(key, "steady")], p90[(key, "failures")]])
    return rows


def plot(data: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = data["runs"]
    keys = list(dict.fromkeys(r["key"] for r in runs))
    by = {(r["key"], r["scenario"]): r for r in runs}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.2
    for i, (scenario, stat, hatch) in enumerate([("steady", "ttft_p50_s", ""), ("steady", "ttft_p99_s", ""),
                                                 ("failures", "ttft_p50_s", "//"), ("failures", "ttft_p99_s", "//")]):
        left.bar([x + (i - 1.5) * width for x in range(len(keys))], [by[(k, scenario)][stat] for k in keys], width,
                 hatch=hatch, alpha=0.5 if "p50" in stat else 0.9, label=f"{stat[5:8]}, {scenario}")
    left.set_yscale("log")
    left.set_xticks(range(len(keys)), keys, rotation=15)
    left.set_ylabel("seconds to first token (simulated)")
    left.set_title(f"{data['pool']['servers']} servers, {data['workload']['agents']} agents")
    left.legend(fontsize=8)
    for j, (scenario, stat) in enumerate([("steady", "hit_rate"), ("failures", "hit_rate"),
                                          ("failures", "failover_hit_rate")]):
        right.bar([x + (j - 1) * 0.27 for x in range(len(keys))], [by[(k, scenario)][stat] or 0 for k in keys], 0.27,
                  label=f"all turns, {scenario}" if stat == "hit_rate" else "turns after their server died")
    right.set_xticks(range(len(keys)), keys, rotation=15)
    right.set_ylabel("prompt tokens read from cache")
    right.set_ylim(0, 1.2)
    right.legend(fontsize=8, loc="upper center", ncol=3)
    fig.suptitle("Simulated with this machine's costs (SmolLM2, 2 cores). For scale only, llm-d's published p90 "
                 "TTFT on 16 H100s with Qwen3-32B: precise 0.54 s, approximate 31 s, random 92.6 s", fontsize=8)
    save_plot(fig, "pool_sim")


if __name__ == "__main__":
    main()
