"""The event loop: agents' turns arrive, are routed, queue on a server and are served from
its cache, the shared tier or a prefill; servers die and join.

A server serves one request at a time in arrival order (its compute: the two cores of this
machine). A turn's time to first token is its wait in that queue, plus restoring what it
reuses from the server's disk or the shared tier, plus prefilling the rest. Its reply then
streams at one agent's decode speed while the server's queue is charged the reply's share
of batched decoding. After each turn the server holds the conversation (prompt and reply)
in memory; with the tier it is also uploaded once the reply is done (lost if the server
dies before the upload ends). A killed server loses memory and disk; the requests it had in
flight are sent again after ``detect_s``, their time to first token counted from the
client's first attempt.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.pool_sim.cluster import Cluster, Server, system_key
from benchmarks.pool_sim.costs import BLOCK_TOKENS, Costs
from benchmarks.pool_sim.routers import Agents, Router
from benchmarks.pool_sim.workload import Plan

KILL, START, DONE, ARRIVE = range(4)  # at equal times: servers change first, then replies end, then turns arrive


@dataclass(frozen=True)
class Pool:
    servers: int = 1000
    memory_tokens: int = 175_000  # per server: see costs_to_tokens
    disk_tokens: int = 1_750_000


@dataclass(frozen=True)
class Faults:
    kill_fraction: float = 0.0  # of the starting servers, each killed once during the window
    join_fraction: float = 0.0  # new servers (more slots) that join during the window
    window: tuple[float, float] = (0.25, 0.75)  # of the agents' arrival window
    rejoin_s: float = 600.0  # a killed server comes back, empty, after this (inf: never)
    detect_s: float = 1.0  # a request on a killed server is sent again after this


@dataclass
class Result:
    policy: str
    turns: int
    prompt_tokens: int
    hit_tokens: int
    ideal_tokens: int
    tier_tokens: int
    ttft_s: np.ndarray
    failover_ttft_s: np.ndarray
    failover_prompt_tokens: int
    failover_hit_tokens: int
    retried: int
    utilization: float
    placements_over_bound: int
    end_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens

    def summary(self) -> dict[str, Any]:
        def pct(values: np.ndarray, q: float) -> float | None:
            return float(np.percentile(values, q)) if len(values) else None

        return {"policy": self.policy, "turns": self.turns, "hit_rate": self.hit_rate,
                "ideal_hit_rate": self.ideal_tokens / self.prompt_tokens,
                "from_tier": self.tier_tokens / self.prompt_tokens,
                "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p90_s": pct(self.ttft_s, 90),
                "ttft_p99_s": pct(self.ttft_s, 99), "ttft_mean_s": float(self.ttft_s.mean()),
                "failover_turns": len(self.failover_ttft_s),
                "failover_hit_rate": (self.failover_hit_tokens / self.failover_prompt_tokens
                                      if self.failover_prompt_tokens else None),
                "failover_ttft_p50_s": pct(self.failover_ttft_s, 50),
                "failover_ttft_p99_s": pct(self.failover_ttft_s, 99),
                "retried_requests": self.retried, "utilization": self.utilization, "simulated_s": self.end_s}


def memory_tokens(budget_bytes: int, costs: Costs) -> int:
    return int(budget_bytes / costs.kv_bytes_per_token)


class SharedTier:
    """What the S3 tier holds: each conversation's last upload that finished (an upload ends
    after the reply; it is lost if its server dies first), and each system prompt's blocks."""

    def __init__(self, servers: list[Server], n_agents: int, n_prompts: int) -> None:
        self._servers = servers
        self._done = [0] * n_agents
        # (tokens, ready at, server, its incarnation) of the upload under way
        self._pending: list[tuple[int, float, int, int] | None] = [None] * n_agents
        self._prompt_ready = [math.inf] * n_prompts

    def tokens(self, a: int, now: float) -> int:
        pending = self._pending[a]
        if pending is not None and pending[1] <= now:
            tokens, ready, s, incarnation = pending
            deaths = self._servers[s].deaths
            if incarnation >= len(deaths) or deaths[incarnation] >= ready:  # its server lived to finish it
                self._done[a] = tokens
            self._pending[a] = None
        return self._done[a]

    def upload(self, a: int, tokens: int, ready: float, server: Server) -> None:
        self._pending[a] = (tokens, ready, server.sid, server.incarnation)

    def prompt_ready(self, prompt: int, now: float) -> bool:
        return self._prompt_ready[prompt] <= now

    def upload_prompt(self, prompt: int, ready: float) -> None:
        self._prompt_ready[prompt] = min(self._prompt_ready[prompt], ready)


@dataclass(slots=True)
class Turn:
    """A turn as served, counted when its reply is done (an attempt lost with its server is not)."""

    ttft_s: float
    prompt: int
    hit: int
    from_tier: int
    ideal: int  # what a perfect cache would save: all but the new message (the system prompt's full blocks on turn 1)
    failover: bool  # its agent's previous server had died


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    failover_ttfts: list[float] = field(default_factory=list)
    prompt = hit = ideal = from_tier = failover_prompt = failover_hit = retried = over_bound = 0

    def add(self, turn: Turn) -> None:
        self.ttfts.append(turn.ttft_s)
        self.prompt += turn.prompt
        self.hit += turn.hit
        self.from_tier += turn.from_tier
        self.ideal += turn.ideal
        if turn.failover:
            self.failover_ttfts.append(turn.ttft_s)
            self.failover_prompt += turn.prompt
            self.failover_hit += turn.hit


class Simulation:
    def __init__(self, plan: Plan, pool: Pool, faults: Faults, router: Router, costs: Costs, seed: int = 0,
                 watch_balance: float | None = None) -> None:
        self.plan, self.faults, self.router, self.costs, self.watch_balance = plan, faults, router, costs, watch_balance
        n_agents, n_prompts = len(plan.arrival), len(plan.system_tokens)
        n_joins = round(faults.join_fraction * pool.servers)
        self.cluster = Cluster(pool.servers, pool.servers + n_joins, pool.memory_tokens, pool.disk_tokens, n_prompts,
                               track_spread=router.needs_spread)
        self.agents = Agents.empty(n_agents)
        router.bind(self.cluster, self.agents, seed)
        self.tier = SharedTier(self.cluster.servers, n_agents, n_prompts) if router.tier else None
        self.shared = [t // BLOCK_TOKENS * BLOCK_TOKENS for t in plan.system_tokens]  # full blocks of each prompt
        self._prompt_upload_s = [costs.tier_fetch_s(t) for t in self.shared]
        self.context = [0] * n_agents  # tokens of the conversation before its next user message
        self.turn = [0] * n_agents
        self.sequence = [0] * n_agents  # of the agent's current request: a reply from an older one is void
        self.asked = list(plan.arrival)  # when the client first sent the current turn
        self.serving: list[Turn | None] = [None] * n_agents
        self.tally = Tally()
        self.now = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []  # (time, kind, order, who, sequence)
        self._order = 0
        rng = random.Random(seed)
        window = [f * max(plan.arrival) for f in faults.window]
        for s in rng.sample(range(pool.servers), round(faults.kill_fraction * pool.servers)):
            self._push(rng.uniform(*window), KILL, s)
        for s in range(pool.servers, pool.servers + n_joins):
            self._push(rng.uniform(*window), START, s)
        for a, at in enumerate(plan.arrival):
            self._push(at, ARRIVE, a)

    def _push(self, time: float, kind: int, who: int, sequence: int = 0) -> None:
        self._order += 1
        heapq.heappush(self._events, (time, kind, self._order, who, sequence))

    def run(self) -> Result:
        events = self._events
        while events:
            self.now, kind, _, who, sequence = heapq.heappop(events)
            if kind == ARRIVE:
                self._arrive(who)
            elif kind == DONE:
                self._done(who, sequence)
            elif kind == KILL:
                self._kill(who)
            else:
                self.cluster.start(who, self.now)
        return self._result()

    def _arrive(self, a: int) -> None:
        plan, now = self.plan, self.now
        prompt = plan.system[a]
        if not self.context[a]:
            self.context[a] = plan.system_tokens[prompt]
        s = self.router.route(a, prompt, self.shared[prompt])
        if s < 0:  # nothing alive: the client tries again
            self._push(now + self.faults.detect_s, ARRIVE, a)
            return
        server = self.cluster.servers[s]
        i = plan.first[a] + self.turn[a]
        context, reply = self.context[a], plan.reply[i]
        n_prompt = context + plan.user[i]
        hit, from_tier, restore_s = self._reuse(server, a, prompt, context)
        service = restore_s + self.costs.overhead_s + self.costs.prefill_s(hit, n_prompt - hit)
        first_token = max(now, server.busy_until) + service
        decoding = reply / self.costs.decode_batch_tokens_per_s  # its share of the server's batched decoding
        server.busy_until = first_token + decoding
        server.work_s += service + decoding
        done = first_token + reply / self.costs.decode_stream_tokens_per_s
        failover = self._move(a, server)
        self.serving[a] = Turn(first_token - self.asked[a], n_prompt, hit, from_tier,
                               self.shared[prompt] if self.turn[a] == 0 else context, failover)
        self._keep(server, a, prompt, n_prompt + reply, done)
        self.sequence[a] += 1
        server.inflight[a] = self.sequence[a]
        self.cluster.add_busy(s, +1)
        self._push(done, DONE, a, self.sequence[a])

    def _reuse(self, server: Server, a: int, prompt: int, context: int) -> tuple[int, int, float]:
        """(tokens reused, of which fetched from the tier, seconds to restore them): the longest
        of the agent's conversation and its system prompt in the server's memory or disk, or
        in the shared tier."""
        own, own_in_memory = server.held(a)
        own = min(own, context)
        shared, shared_in_memory = server.held(system_key(prompt)) if self.shared[prompt] else (0, False)
        hit = max(own, shared)
        in_memory = max(own if own_in_memory else 0, shared if shared_in_memory else 0)
        if self.tier is not None:
            remote = min(self.tier.tokens(a, self.now), context)
            if self.tier.prompt_ready(prompt, self.now):
                remote = max(remote, self.shared[prompt])
            if remote > hit:
                fetch_s = self.costs.tier_fetch_s(remote - hit)
                return remote, remote - hit, fetch_s + self.costs.disk_s(remote - in_memory)
        return hit, 0, self.costs.disk_s(hit - in_memory)

    def _move(self, a: int, server: Server) -> bool:
        """Make ``server`` the agent's home; returns whether its previous one had died."""
        agents, cluster = self.agents, self.cluster
        failover = agents.home[a] >= 0 and not agents.home_alive(cluster, a)
        if agents.home[a] == server.sid and not failover:
            return False
        if agents.home[a] >= 0 and not failover:
            cluster.add_held(agents.home[a], -1)
        cluster.add_held(server.sid, +1)
        agents.home[a], agents.home_incarnation[a] = server.sid, server.incarnation
        if self.watch_balance is not None and cluster.held[server.sid] > math.ceil(
                self.watch_balance * cluster.total_held / len(cluster.alive)):
            self.tally.over_bound += 1
        return failover

    def _keep(self, server: Server, a: int, prompt: int, conversation: int, done: float) -> None:
        """After the turn the server holds the conversation, and uploads it to the tier."""
        shared = self.shared[prompt]
        if shared:
            self.cluster.keep(server.sid, system_key(prompt), shared, shared)
        self.cluster.keep(server.sid, a, conversation, conversation - shared)
        if server.sid not in self.agents.seen[a]:
            self.agents.seen[a].append(server.sid)
        if self.tier is not None:
            new = conversation - min(self.tier.tokens(a, self.now), conversation)
            self.tier.upload(a, conversation, done + self.costs.tier_fetch_s(new), server)
            self.tier.upload_prompt(prompt, done + self._prompt_upload_s[prompt])

    def _done(self, a: int, sequence: int) -> None:
        if sequence != self.sequence[a]:
            return  # its server died meanwhile: the turn was sent again
        s = self.agents.home[a]
        del self.cluster.servers[s].inflight[a]
        self.cluster.add_busy(s, -1)
        turn = self.serving[a]
        assert turn is not None
        self.tally.add(turn)
        i = self.plan.first[a] + self.turn[a]
        self.context[a] += self.plan.user[i] + self.plan.reply[i]
        self.turn[a] += 1
        if i + 1 < self.plan.first[a + 1]:
            self.asked[a] = self.now + self.plan.think[i]
            self._push(self.asked[a], ARRIVE, a)
        else:  # the agent is gone
            self.cluster.add_held(s, -1)
            self.agents.home[a] = -1

    def _kill(self, s: int) -> None:
        for a in self.cluster.kill(s, self.now):
            self.sequence[a] += 1
            self.tally.retried += 1
            self._push(self.now + self.faults.detect_s, ARRIVE, a)
        if math.isfinite(self.faults.rejoin_s):
            self._push(self.now + self.faults.rejoin_s, START, s)

    def _result(self) -> Result:
        servers, now, tally = self.cluster.servers, self.now, self.tally
        up_s = sum(sv.up_s + (now - sv.up_since if sv.alive else 0) for sv in servers)
        return Result(policy=self.router.name, turns=len(tally.ttfts), prompt_tokens=tally.prompt,
                      hit_tokens=tally.hit, ideal_tokens=tally.ideal, tier_tokens=tally.from_tier,
                      ttft_s=np.array(tally.ttfts), failover_ttft_s=np.array(tally.failover_ttfts),
                      failover_prompt_tokens=tally.failover_prompt, failover_hit_tokens=tally.failover_hit,
                      retried=tally.retried, utilization=sum(sv.work_s for sv in servers) / up_s if up_s else 0.0,
                      placements_over_bound=tally.over_bound, end_s=now)


def simulate(plan: Plan, pool: Pool, faults: Faults, router: Router, costs: Costs, seed: int = 0,
             watch_balance: float | None = None) -> Result:
    """Run every agent of ``plan`` to its last turn. ``watch_balance``: count placements that
    leave a server holding more than ``ceil(watch_balance * mean)`` agents."""
    return Simulation(plan, pool, faults, router, costs, seed, watch_balance).run()
