"""GET /status: the operator's page (templates/status.html). Plain HTML (no scripts), refreshed every 10 s:
the engine and memory, caches by tier and disk use, agents with their conversations (and
where each one's latest turn's cache came from), the latest cache misses with their
reasons, the worker's job runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import falcon
from sqlalchemy.orm import Session, sessionmaker

from app.api.pages import render
from app.settings import Settings
from app.store import cache_index, jobs, overview

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _time(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else ""


def _last_turn(last: overview.LastTurnCache | None) -> str:
    """``disk · extend · 2176 tokens``: the x-semantic-cache header that turn got, in short."""
    if last is None:
        return ""
    return f"{last.source or '?'} · {last.reason} · {last.n_cached} tokens"


@dataclass(frozen=True)
class PageData:
    engine: dict[str, Any]
    tiers: cache_index.TierCounts
    disk_bytes: int
    disk_budget_bytes: int
    agents: list[overview.AgentRow]
    hot: Mapping[str, int]  # conversation -> tokens in memory
    misses: list[overview.MissRow]
    runs: list[jobs.JobRunView]


def render_page(data: PageData) -> str:
    """The whole page (templates/status.html): a table's cell is (value, kind), kind its class
    (num, a tier) or code."""
    e = data.engine
    cards = [("model", e["model"]), ("status", e["status"]), ("requests running", e["active"]),
             ("waiting", e["queue"]), ("memory pool", f"{_mib(e['pool_bytes'])} of {_mib(e['pool_budget'])}"),
             ("conversations hot", data.tiers.hot), ("warm", data.tiers.warm), ("cold", data.tiers.cold),
             ("disk", f"{_mib(data.disk_bytes)} of {_mib(data.disk_budget_bytes)}")]
    agent_rows = []
    for agent in data.agents:
        conversations = agent.conversations or (overview.ConversationRow("", 0, 0, "none", agent.last_access_at),)
        for i, c in enumerate(conversations):
            tier, tokens = ("hot", data.hot[c.id]) if c.id in data.hot else (c.tier, c.cached_tokens)
            first = [(agent.id, ""), (agent.origin, ""), (agent.turns, "num"),
                     ("" if agent.hit_rate is None else f"{agent.hit_rate:.1%}", "num")] if i == 0 else [("", "")] * 4
            agent_rows.append(first + [(c.id or "-", ""), (c.n_messages, "num"), (tier, tier), (tokens, "num"),
                                       (_last_turn(c.last_turn), ""), (_time(c.last_access_at), "")])
    miss_rows = [[(_time(m.created_at), ""), (m.agent_id or "", ""), (m.reason, ""), (m.n_cached, "num"),
                  (m.n_input, "num"), (m.part or "", ""), (m.stored or "", "code"), (m.new or "", "code")]
                 for m in data.misses]
    run_rows = [[(r.name, ""), (r.status, ""), (_time(r.started_at), ""),
                 (", ".join(f"{k} {v}" for k, v in r.result.items() if isinstance(v, (int, float, bool))), "")]
                for r in data.runs]
    tables = [("Agents and their conversations", ["agent", "origin", "turns", "cache hit rate", "conversation",
                                                  "messages", "tier", "cached tokens", "last turn's cache",
                                                  "last access (UTC)"], agent_rows, "No agents yet."),
              ("Latest cache misses", ["time (UTC)", "agent", "reason", "cached", "prompt", "parted in",
                                       "stored text there", "new text there"], miss_rows, "No cache misses recorded."),
              ("Worker jobs (last run of each)", ["job", "status", "started (UTC)", "result"], run_rows,
               "No job has run yet.")]
    return render("status.html", now=_time(datetime.now(UTC)), cards=cards, tables=tables)


class StatusPageResource:
    def __init__(self, engine: EngineSurface, sessions: sessionmaker[Session], settings: Settings) -> None:
        self._engine = engine
        self._sessions = sessions
        self._settings = settings

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        status = self._engine.status()
        cache = status.cache
        engine = {"model": status.model or "loading", "status": "ok" if status.healthy else
                  "loading" if status.loading else "unavailable", "active": status.n_active,
                  "queue": status.queue_depth, "pool_bytes": cache.pool_bytes if cache else 0,
                  "pool_budget": cache.budget_bytes if cache else self._settings.cache_memory_bytes}
        with self._sessions() as session:
            agents = overview.agents(session)
            misses = overview.recent_misses(session)
            hot = self._engine.hot_conversations()
            tiers = cache_index.count_tiers(session, hot.keys())
            disk = cache_index.disk_bytes(session)
            runs = jobs.last_runs(session)
        resp.content_type = "text/html; charset=utf-8"
        resp.text = render_page(PageData(engine, tiers, disk, self._settings.disk_budget_bytes, agents, hot, misses,
                                         runs))
