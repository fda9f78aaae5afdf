"""benchmarks/pool_sim: the pool simulation's policies do what they claim (pure Python, fast)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from benchmarks.common import RESULTS
from benchmarks.pool_sim.cluster import Cluster, Server, system_key
from benchmarks.pool_sim.costs import Costs, load_costs
from benchmarks.pool_sim.routers import Affinity, Agents, PrefixAware, Random, Router
from benchmarks.pool_sim.sim import Faults, Pool, Result, SharedTier, simulate
from benchmarks.pool_sim.workload import Workload, make_plan

# Round numbers of this machine's order (the real ones come from benchmarks/results/, tested below).
COSTS = Costs(overhead_s=0.25, prefill_s_per_token=2.4e-3, attention_s_per_token2=1e-6,
              disk_restore_tokens_per_s=9000, s3_latency_s=0.015, s3_bytes_per_s=5e8, kv_bytes_per_token=12240,
              decode_stream_tokens_per_s=8.3, decode_batch_tokens_per_s=40)
WORKLOAD = Workload(agents=600, arrival_s=1800, system_prompts=4)
AMPLE = Pool(servers=8, memory_tokens=10**9, disk_tokens=10**9)


def run(router: Router, pool: Pool = AMPLE, faults: Faults = Faults(), seed: int = 0,
        watch_balance: float | None = None) -> Result:
    return simulate(make_plan(WORKLOAD, seed), pool, faults, router, COSTS, seed=seed, watch_balance=watch_balance)


def test_same_seed_same_run_and_another_seed_another() -> None:
    faults = Faults(kill_fraction=0.25, join_fraction=0.25)
    first, again = (run(Random(), faults=faults, seed=3).summary() for _ in range(2))
    assert first == again
    assert run(Random(), faults=faults, seed=4).summary() != first


def test_affinity_reads_all_but_the_new_tokens_with_ample_memory() -> None:
    result = run(Affinity(tier=False))
    ideal = result.ideal_tokens / result.prompt_tokens
    assert 0.5 < ideal < 0.99
    # Only each server's first use of each system prompt is prefilled beyond the ideal.
    assert result.hit_rate > ideal - 0.01


def test_random_routing_reads_far_less_than_affinity() -> None:
    affinity, scattered = run(Affinity(tier=False)), run(Random())
    assert scattered.hit_rate < affinity.hit_rate - 0.2
    assert scattered.ttft_s.mean() > affinity.ttft_s.mean()


def test_after_a_failure_the_tier_restores_what_a_pool_without_it_prefills() -> None:
    faults = Faults(kill_fraction=0.25)
    with_tier, without = run(Affinity(tier=True), faults=faults), run(Affinity(tier=False), faults=faults)
    assert with_tier.failover_ttft_s.size >= 10 and without.failover_ttft_s.size >= 10
    restored = with_tier.failover_hit_tokens / with_tier.failover_prompt_tokens
    prefilled = without.failover_hit_tokens / without.failover_prompt_tokens
    assert restored > 0.85  # all but the new message and what the dead server had not uploaded yet
    assert prefilled < restored - 0.25  # the system prompt at most
    assert with_tier.tier_tokens > 0 and without.tier_tokens == 0
    assert float(with_tier.failover_ttft_s.mean()) < float(without.failover_ttft_s.mean())


def test_without_failures_the_tier_is_hardly_read_under_affinity() -> None:
    result = run(Affinity(tier=True))
    assert result.tier_tokens / result.prompt_tokens < 0.01  # each agent's turns stay on its server


def test_a_small_memory_without_disk_costs_hits() -> None:
    small = Pool(servers=8, memory_tokens=20_000, disk_tokens=0)
    assert run(Affinity(tier=False), pool=small).hit_rate < run(Affinity(tier=False)).hit_rate - 0.2


def test_bounded_load_keeps_every_server_under_the_bound() -> None:
    bounded = run(Affinity(tier=False, placement="hash", balance=1.25), watch_balance=1.25)
    unbounded = run(Affinity(tier=False, placement="hash", balance=math.inf), watch_balance=1.25)
    assert bounded.placements_over_bound == 0
    assert unbounded.placements_over_bound > 0  # plain consistent hashing does overload some server


def test_server_cache_spills_to_disk_then_out() -> None:
    server = Server(0, memory_tokens=1000, disk_tokens=1000)
    assert server.keep(1, 600, 600) == []
    assert server.keep(2, 600, 600) == []  # agent 1 goes to disk
    assert server.held(1) == (600, False) and server.held(2) == (600, True)
    assert server.keep(3, 600, 600) == [1]  # agent 2 to disk too: 1,200 > 1,000, so agent 1 is out
    assert server.held(1) == (0, False)
    assert server.keep(2, 700, 700) == []  # back in memory, grown: agent 3 to disk
    assert server.held(2) == (700, True) and server.held(3) == (600, False)
    assert server.keep(4, 900, 900) == [3]  # agent 2 to disk, the least recent there is out
    assert server.held(2) == (700, False)


def test_an_upload_counts_only_if_its_server_lived_to_finish_it() -> None:
    servers = [Server(0, 10, 10), Server(1, 10, 10)]
    tier = SharedTier(servers, n_agents=2, n_prompts=1)
    tier.upload(0, 1000, ready=5.0, server=servers[0])
    tier.upload(1, 2000, ready=5.0, server=servers[1])
    assert tier.tokens(0, now=4.0) == 0  # not there yet
    servers[0].kill(now=4.5)  # before its upload ended
    servers[1].kill(now=5.5)  # after
    assert tier.tokens(0, now=6.0) == 0
    assert tier.tokens(1, now=6.0) == 2000


def cluster_with(holdings: dict[int, list[tuple[int, int]]], busy: dict[int, int]) -> Cluster:
    cluster = Cluster(4, 4, 10**6, 10**6, n_prompts=1, track_spread=True)
    for s, keys in holdings.items():
        for key, tokens in keys:
            cluster.keep(s, key, tokens, tokens)
    for s, n in busy.items():
        cluster.add_busy(s, n)
    return cluster


def test_prefix_router_follows_the_longest_cached_prefix_unless_loads_are_imbalanced() -> None:
    holdings = {0: [(system_key(0), 2048)], 1: [(system_key(0), 2048), (7, 3000)], 2: [(system_key(0), 2048)]}
    agents = Agents.empty(10)
    agents.seen[7] = [1]
    router = PrefixAware()
    router.bind(cluster_with(holdings, {1: 3, 2: 1}), agents, seed=0)
    assert router.route(7, 0, 2048) == 1  # its conversation, though busier
    assert router.route(8, 0, 2048) == 0  # a new agent: the least busy server holding its system prompt
    router.bind(cluster_with(holdings, {1: 40, 3: 1}), agents, seed=0)  # 40 - 0 > 32 and 40 > 1.1 x 0
    assert router.route(7, 0, 2048) in (0, 2)  # imbalanced: the least loaded


def test_affinity_keeps_an_agent_on_its_live_server_and_moves_it_when_that_dies() -> None:
    cluster = cluster_with({}, {0: 2, 1: 1, 2: 0, 3: 5})
    agents = Agents.empty(2)
    router = Affinity()
    router.bind(cluster, agents, seed=0)
    agents.home[0], agents.home_incarnation[0] = 3, 0
    assert router.route(0, 0, 0) == 3  # its server, the busiest
    assert router.route(1, 0, 0) == 2  # a new agent: the least busy
    cluster.kill(3, now=1.0)
    assert router.route(0, 0, 0) == 2


def test_costs_from_this_machines_results() -> None:
    costs = load_costs(RESULTS)
    assert set(costs.sources) >= {"prefill", "disk_restore", "s3", "kv_bytes_per_token", "decode_stream",
                                  "decode_batch"}
    assert all("json" in source for source in costs.sources.values())
    cold_2144 = costs.overhead_s + costs.prefill_s(0, 2144)
    peers = json.loads((RESULTS / "peers.json").read_text())["servers"]["semantic"]["turns"][0]
    assert peers["prompt_tokens"] == 2144
    assert cold_2144 == pytest.approx(peers["ttft_s"], rel=0.05)  # the fit meets Semantic's cold first turn
    warm = costs.overhead_s + costs.prefill_s(4000, 240)
    assert warm < cold_2144 / 3
    assert costs.tier_fetch_s(4096) + costs.disk_s(4096) < (costs.overhead_s + costs.prefill_s(0, 4096)) / 5


def test_the_plan_grows_each_conversation_within_the_context() -> None:
    plan = make_plan(dataclasses.replace(WORKLOAD, agents=50), seed=1)
    for a in range(50):
        turns = range(plan.first[a], plan.first[a + 1])
        assert len(turns) >= 1
        total = plan.system_tokens[plan.system[a]] + sum(plan.user[i] + plan.reply[i] for i in turns)
        assert total <= WORKLOAD.max_context or len(turns) == 1
