"""Which agents this server owns in a pool, and the epoch it saw for each (``app.store.ownership``).

The cache manager asks before it serves an agent (``claim``), before it brings an agent's
cache back after a start (``still_mine``) and before it stores a turn's cache (``current``:
the turn began under the epoch seen now; ``epoch`` is read as the turn's lease is taken). As
the server stops it gives its agents up (``release_all``). Outside a pool (no owner id) every
agent is this server's: each question answers yes, and the store is never asked.
"""

from __future__ import annotations

import logging
from typing import Literal

from app.clock import utcnow
from app.store.cache_index import CacheIndex

log = logging.getLogger(__name__)

# How a claim went: "mine" (no other server owned the agent since this one last served it),
# "moved" (one did: what this server holds in memory for the agent may be older than the
# store, and must go), "unreachable" (the store cannot be reached: the turn runs cold).
Claim = Literal["mine", "moved", "unreachable"]


class Ownership:
    """``owner``: this server's id in a pool (None: no pool)."""

    def __init__(self, index: CacheIndex, owner: str | None) -> None:
        self.owner = owner
        self._index = index
        self._epochs: dict[str, int] = {}  # each agent's epoch when this server last served it

    def claim(self, agent_id: str) -> Claim:
        """Make this server the agent's owner (in a pool) and remember the epoch."""
        if self.owner is None:
            return "mine"
        try:
            epoch = self._index.claim(agent_id, self.owner, utcnow())
        except Exception as exc:
            log.warning("agent %s: ownership not claimed (%s); no cache this turn", agent_id, exc)
            return "unreachable"
        seen = self._epochs.get(agent_id, epoch)
        self._epochs[agent_id] = epoch
        if seen != epoch:
            log.info("agent %s: owned by another server since epoch %d", agent_id, seen)
            return "moved"
        return "mine"

    def still_mine(self, agent_id: str) -> bool:
        """Whether this server still owns the agent, without claiming it; remembers the epoch
        read, as a claim does (a server prefetches only its own agents)."""
        if self.owner is None:
            return True
        owner = self._index.owner(agent_id)
        if owner is None or owner[0] != self.owner:
            return False
        self._epochs[agent_id] = owner[1]
        return True

    def epoch(self, agent_id: str | None) -> int | None:
        """The agent's epoch this server saw last (None: none seen, or no pool): a lease's."""
        return self._epochs.get(agent_id) if agent_id is not None else None

    def current(self, agent_id: str, epoch: int | None) -> bool:
        """Whether a turn whose lease was taken at ``epoch`` may still store its cache: no
        other server took the agent since (outside a pool, always)."""
        return self.owner is None or epoch == self._epochs.get(agent_id)

    def release_all(self) -> None:
        """In a pool, as the server stops: give up the agents it owns (the store down: the
        next server's claim takes them anyway)."""
        if self.owner is None:
            return
        try:
            released = self._index.release_all(self.owner, utcnow())
            log.info("released %d agent(s) to the pool", released)
        except Exception as exc:
            log.warning("agents not released (%s)", exc)
