"""GET /status: the operator's page. Plain HTML (no scripts), refreshed every 10 seconds:
the engine and memory, caches by tier and disk use, agents with their conversations (and
where each one's latest turn's cache came from), the latest cache misses with their
reasons, the worker's job runs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape
from typing import TYPE_CHECKING, Any, Mapping

import falcon
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.store import cache_index, jobs, overview

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{background:#fff;border:1px solid #dde2ea;border-radius:6px;
padding:10px 14px;min-width:150px} .card b{display:block;font-size:18px}
table{border-collapse:collapse;background:#fff;width:100%} th,td{border:1px solid #dde2ea;padding:4px 8px;
text-align:left;vertical-align:top} th{background:#eef1f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:12px;white-space:pre-wrap;word-break:break-all} .hot{color:#b4220b} .warm{color:#a86400}
.cold,.none{color:#6b7280} .muted{color:#6b7280}
"""


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _time(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else ""


def _table(headers: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(rows_cells) + "</tr>" for rows_cells in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any, kind: str = "") -> str:
    return f'<td class="{kind}">{escape(str(value))}</td>' if kind else f"<td>{escape(str(value))}</td>"


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
    """The whole page; every value from the store is escaped."""
    e = data.engine
    cards = [("model", e["model"]), ("status", e["status"]), ("requests running", e["active"]),
             ("waiting", e["queue"]), ("memory pool", f"{_mib(e['pool_bytes'])} of {_mib(e['pool_budget'])}"),
             ("conversations hot", data.tiers.hot), ("warm", data.tiers.warm), ("cold", data.tiers.cold),
             ("disk", f"{_mib(data.disk_bytes)} of {_mib(data.disk_budget_bytes)}")]
    card_html = "".join(f'<div class="card">{escape(k)}<b>{escape(str(v))}</b></div>' for k, v in cards)
    agent_rows = []
    for agent in data.agents:
        conversations = agent.conversations or (overview.ConversationRow("", 0, 0, "none", agent.last_access_at),)
        for i, c in enumerate(conversations):
            tier, tokens = ("hot", data.hot[c.id]) if c.id in data.hot else (c.tier, c.cached_tokens)
            first = [_cell(agent.id), _cell(agent.origin), _cell(agent.turns, "num"),
                     _cell("" if agent.hit_rate is None else f"{agent.hit_rate:.1%}", "num")] if i == 0 else \
                [_cell("")] * 4
            agent_rows.append(first + [_cell(c.id or "-"), _cell(c.n_messages, "num"), _cell(tier, tier),
                                       _cell(tokens, "num"), _cell(_last_turn(c.last_turn)),
                                       _cell(_time(c.last_access_at))])
    miss_rows = [[_cell(_time(m.created_at)), _cell(m.agent_id or ""), _cell(m.reason), _cell(m.n_cached, "num"),
                  _cell(m.n_input, "num"), _cell(m.part or ""),
                  f"<td><code>{escape(m.stored or '')}</code></td>", f"<td><code>{escape(m.new or '')}</code></td>"]
                 for m in data.misses]
    run_rows = [[_cell(r.name), _cell(r.status), _cell(_time(r.started_at)),
                 _cell(", ".join(f"{k} {v}" for k, v in r.result.items() if isinstance(v, (int, float, bool))))]
                for r in data.runs]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">'
        f"<title>Semantic status</title><style>{STYLE}</style></head><body>"
        f'<h1>Semantic</h1><p class="muted">refreshed every 10 s · {escape(_time(datetime.now(timezone.utc)))} UTC · '
        '<a href="/agents">the agents page</a>: talk to agents, their conversations and caches</p>'
        f'<div class="cards">{card_html}</div>'
        "<h2>Agents and their conversations</h2>"
        + _table(["agent", "origin", "turns", "cache hit rate", "conversation", "messages", "tier", "cached tokens",
                  "last turn's cache", "last access (UTC)"], agent_rows, "No agents yet.")
        + "<h2>Latest cache misses</h2>"
        + _table(["time (UTC)", "agent", "reason", "cached", "prompt", "parted in", "stored text there",
                  "new text there"], miss_rows, "No cache misses recorded.")
        + "<h2>Worker jobs (last run of each)</h2>"
        + _table(["job", "status", "started (UTC)", "result"], run_rows, "No job has run yet.")
        + "</body></html>")


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
