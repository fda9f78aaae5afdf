"""Where each turn goes: the three routing policies compared.

- ``Affinity`` is Semantic's pool: an agent's turns go to the server that holds it (its
  owner: HAProxy's stick table, the ``owners`` table); an agent with no live owner (new,
  or its server died) is placed on the least-loaded server, or by consistent hashing with
  bounded load (``placement="hash"``: the first server clockwise from the agent's hash on
  a ring holding fewer than ``ceil(balance * mean)`` agents, Mirrokni et al.). With
  ``tier`` the servers write through to the shared S3 tier, so a moved agent restores.
- ``PrefixAware`` is SGLang's router (SMG 1.13 ``cache_aware``, event-driven: it knows what
  each server really caches, as llm-d's precise prefix-cache scorer does): when the loads
  are imbalanced (max - min requests in flight > 32 and max > 1.1 x min, SMG's defaults)
  the least-loaded server, else the server caching the longest prefix of the prompt
  (ties: the less loaded), else the least-loaded.
- ``Random`` picks any alive server.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from benchmarks.pool_sim.cluster import Cluster

MASK64 = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64: a well-spread, deterministic hash of an integer (Python's hash of an int is the int)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@dataclass
class Agents:
    """What the routers may read about each agent: the server its last turn ran on (and that
    server's incarnation then), and the servers that have held its conversation."""

    home: list[int]
    home_incarnation: list[int]
    seen: list[list[int]] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int) -> Agents:
        return cls([-1] * n, [0] * n, [[] for _ in range(n)])

    def home_alive(self, cluster: Cluster, a: int) -> bool:
        s = self.home[a]
        return s >= 0 and cluster.servers[s].alive and cluster.servers[s].incarnation == self.home_incarnation[a]


class Router:
    name = "router"
    tier = False  # the servers write through to, and restore from, the shared tier
    needs_spread = False  # reads the cluster's min_busy and max_busy

    def bind(self, cluster: Cluster, agents: Agents, seed: int) -> None:
        self.cluster, self.agents = cluster, agents

    def route(self, a: int, prompt: int, shared_tokens: int) -> int:
        """The server for agent ``a``'s next turn (``prompt``: its system prompt, of which
        ``shared_tokens`` are in full blocks), or -1 if no server is alive."""
        raise NotImplementedError


class Affinity(Router):
    def __init__(self, tier: bool = True, placement: str = "least", balance: float = 1.25, vnodes: int = 40) -> None:
        if placement not in ("least", "hash"):
            raise ValueError(f"placement: {placement!r} is neither 'least' nor 'hash'")
        self.tier, self.placement, self.balance, self.vnodes = tier, placement, balance, vnodes
        self.name = f"affinity ({'shared tier' if tier else 'no tier'}{', hash' if placement == 'hash' else ''})"
        self._ring: list[int] = []
        self._owners: list[int] = []

    def bind(self, cluster: Cluster, agents: Agents, seed: int) -> None:
        super().bind(cluster, agents, seed)
        points = sorted((mix(s * 1_000_003 + v), s) for s in range(len(cluster.servers)) for v in range(self.vnodes))
        self._ring, self._owners = [p for p, _ in points], [s for _, s in points]

    def route(self, a: int, prompt: int, shared_tokens: int) -> int:
        if self.agents.home_alive(self.cluster, a):
            return self.agents.home[a]
        return self.cluster.least_loaded() if self.placement == "least" else self._hashed(a)

    def _hashed(self, a: int) -> int:
        cluster = self.cluster
        if not cluster.alive:
            return -1
        bound = (math.ceil(self.balance * (cluster.total_held + 1) / len(cluster.alive))
                 if math.isfinite(self.balance) else math.inf)
        start = bisect.bisect(self._ring, mix(a))
        for step in range(len(self._owners)):
            s = self._owners[(start + step) % len(self._owners)]
            if cluster.servers[s].alive and cluster.held[s] + 1 <= bound:
                return s
        return -1


class PrefixAware(Router):
    needs_spread = True

    def __init__(self, abs_threshold: int = 32, rel_threshold: float = 1.1) -> None:
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.name = "prefix-aware (SGLang/llm-d precise)"

    def route(self, a: int, prompt: int, shared_tokens: int) -> int:
        cluster = self.cluster
        if (cluster.max_busy - cluster.min_busy > self.abs_threshold
                and cluster.max_busy > self.rel_threshold * cluster.min_busy):
            return cluster.least_loaded()
        best, best_tokens, best_key = -1, 0, math.inf
        holders = []
        for s in self.agents.seen[a]:
            server = cluster.servers[s]
            tokens = server.held(a)[0] if server.alive else 0
            if not tokens:
                continue
            holders.append(s)
            if tokens > best_tokens or (tokens == best_tokens and cluster.load_key[s] < best_key):
                best, best_tokens, best_key = s, tokens, cluster.load_key[s]
        self.agents.seen[a] = holders
        if shared_tokens and shared_tokens >= best_tokens:
            s = cluster.least_loaded(cluster.has_prompt[prompt])
            if s >= 0 and (shared_tokens > best_tokens or cluster.load_key[s] < best_key):
                best = s
        return best if best >= 0 else cluster.least_loaded()


class Random(Router):
    def __init__(self, tier: bool = False) -> None:
        self.tier = tier
        self.name = f"random ({'shared tier' if tier else 'no tier'})"

    def bind(self, cluster: Cluster, agents: Agents, seed: int) -> None:
        super().bind(cluster, agents, seed)
        self._rng = random.Random(seed)

    def route(self, a: int, prompt: int, shared_tokens: int) -> int:
        alive = self.cluster.alive
        return alive[self._rng.randrange(len(alive))] if alive else -1
