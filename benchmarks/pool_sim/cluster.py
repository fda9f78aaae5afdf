"""The simulated servers: each one's cache (memory, then its own disk, least recently used
out first) and compute (one queue), and the pool's view of their loads.

A server's cache holds conversations by agent (key ``a >= 0``: the conversation's first
``tokens`` are cached) and system prompts (key ``-1 - prompt``: its full blocks, shared by
every agent on the server, as content-addressed blocks are). A conversation's entry is
sized without the system prompt's blocks, which are counted once under their own key.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict

import numpy as np

BUSY_WEIGHT = 1e6  # the load key: requests in flight first, then agents held
NONE: list[int] = []  # nothing dropped (not to be changed)


def system_key(prompt: int) -> int:
    return -1 - prompt


class Server:
    __slots__ = ("sid", "alive", "incarnation", "busy_until", "work_s", "memory", "disk", "memory_used",
                 "disk_used", "memory_tokens", "disk_tokens", "inflight", "deaths", "up_since", "up_s")

    def __init__(self, sid: int, memory_tokens: int, disk_tokens: int) -> None:
        self.sid = sid
        self.memory_tokens, self.disk_tokens = memory_tokens, disk_tokens
        self.alive = False
        self.incarnation = 0
        self.busy_until = 0.0
        self.work_s = 0.0
        self.memory: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (tokens, size)
        self.disk: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.memory_used = self.disk_used = 0
        self.inflight: dict[int, int] = {}  # agent -> its request's sequence number
        self.deaths: list[float] = []  # deaths[i]: when incarnation i ended
        self.up_since = 0.0
        self.up_s = 0.0  # seconds alive before up_since

    def held(self, key: int) -> tuple[int, bool]:
        """(tokens cached for ``key``, whether they are in memory)."""
        entry = self.memory.get(key)
        if entry is not None:
            return entry[0], True
        entry = self.disk.get(key)
        return (entry[0], False) if entry is not None else (0, False)

    def keep(self, key: int, tokens: int, size: int) -> list[int]:
        """Hold ``key`` in memory as the most recently used; what no longer fits moves to
        disk, and out of the disk's budget. Returns the keys dropped altogether (``NONE``,
        shared, when there are none)."""
        old = self.memory.pop(key, None)
        if old is not None:
            self.memory_used -= old[1]
        else:
            old = self.disk.pop(key, None)
            if old is not None:
                self.disk_used -= old[1]
        self.memory[key] = (tokens, size)
        self.memory_used += size
        if self.memory_used <= self.memory_tokens:
            return NONE
        dropped: list[int] = []
        while self.memory_used > self.memory_tokens and len(self.memory) > 1:
            out, entry = self.memory.popitem(last=False)
            self.memory_used -= entry[1]
            if entry[1] <= self.disk_tokens:
                self.disk[out] = entry
                self.disk_used += entry[1]
            else:
                dropped.append(out)
        while self.disk_used > self.disk_tokens:
            out, entry = self.disk.popitem(last=False)
            self.disk_used -= entry[1]
            dropped.append(out)
        return dropped

    def start(self, now: float) -> None:
        self.alive = True
        self.busy_until = self.up_since = now

    def kill(self, now: float) -> None:
        """Gone with its memory and disk (the machine is lost); it may come back empty."""
        self.alive = False
        self.deaths.append(now)
        self.up_s += now - self.up_since
        self.incarnation += 1
        self.memory.clear()
        self.disk.clear()
        self.memory_used = self.disk_used = 0
        self.inflight.clear()


class Cluster:
    """The servers (``capacity`` slots: the first ``n_start`` start alive, the others can join)
    and the loads a router sees: requests in flight and agents held per server."""

    def __init__(self, n_start: int, capacity: int, memory_tokens: int, disk_tokens: int, n_prompts: int,
                 track_spread: bool = False) -> None:
        self.track_spread = track_spread  # keep min_busy and max_busy (a cost on every request)
        self.servers = [Server(s, memory_tokens, disk_tokens) for s in range(capacity)]
        self.busy = [0] * capacity  # requests in flight (queued or running)
        self.held = [0] * capacity  # agents whose last turn ran there
        self.load_key = np.full(capacity, np.inf)  # BUSY_WEIGHT * busy + held; inf: not alive
        self.has_prompt = np.zeros((n_prompts, capacity), dtype=bool)
        self.alive: list[int] = []
        self.total_held = 0
        self._busy_count: dict[int, int] = {}  # how many alive servers have so many requests in flight
        self.min_busy = self.max_busy = 0
        for s in range(n_start):
            self.start(s, 0.0)

    def start(self, s: int, now: float) -> None:
        self.servers[s].start(now)
        self.busy[s] = self.held[s] = 0
        self.load_key[s] = 0.0
        bisect.insort(self.alive, s)
        if self.track_spread:
            self._count(0, +1)

    def kill(self, s: int, now: float) -> list[int]:
        """Kill server ``s``; returns the agents whose requests were in flight on it."""
        server = self.servers[s]
        lost = list(server.inflight)
        if self.track_spread:
            self._count(self.busy[s], -1)
        server.kill(now)
        self.total_held -= self.held[s]
        self.busy[s] = self.held[s] = 0
        self.load_key[s] = np.inf
        self.has_prompt[:, s] = False
        self.alive.remove(s)
        return lost

    def add_busy(self, s: int, delta: int) -> None:
        if self.track_spread:
            self._count(self.busy[s], -1)
            self._count(self.busy[s] + delta, +1)
        self.busy[s] += delta
        self.load_key[s] = BUSY_WEIGHT * self.busy[s] + self.held[s]

    def add_held(self, s: int, delta: int) -> None:
        self.held[s] += delta
        self.total_held += delta
        self.load_key[s] = BUSY_WEIGHT * self.busy[s] + self.held[s]

    def least_loaded(self, among: np.ndarray | None = None) -> int:
        """The alive server with the fewest requests in flight, then the fewest agents held
        (``among``: a mask of the servers to consider); -1 if there is none."""
        keys = self.load_key if among is None else np.where(among, self.load_key, np.inf)
        s = int(np.argmin(keys))
        return s if math.isfinite(keys[s]) else -1

    def keep(self, s: int, key: int, tokens: int, size: int) -> None:
        for out in self.servers[s].keep(key, tokens, size):
            if out < 0:
                self.has_prompt[-1 - out, s] = False
        if key < 0:
            self.has_prompt[-1 - key, s] = True

    def _count(self, value: int, delta: int) -> None:
        """Keep ``min_busy`` and ``max_busy`` over the alive servers without a scan per request."""
        counts = self._busy_count
        if delta > 0:
            if counts:
                self.min_busy, self.max_busy = min(self.min_busy, value), max(self.max_busy, value)
            else:
                self.min_busy = self.max_busy = value
            counts[value] = counts.get(value, 0) + 1
            return
        counts[value] -= 1
        if not counts[value]:
            del counts[value]
            if counts and value == self.max_busy:
                self.max_busy = max(counts)
            if counts and value == self.min_busy:
                self.min_busy = min(counts)
