"""``semantic status``: what an operator wants to know at a glance, from the running
server's ``/health`` and from the store (conversations by tier, disk use, last job runs)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from app.home_lock import serving_address
from app.settings import Settings
from app.store import cache_index, jobs, overview
from app.store.db import make_engine, make_session_factory

HEALTH_TIMEOUT_S = 3
RECENT_CONVERSATIONS = 5


@dataclass(frozen=True, slots=True)
class RecentTurn:
    """Where a recently used conversation's latest turn read its cache from (the
    ``x-semantic-cache`` header that turn got)."""

    agent_id: str
    conversation_id: str
    source: str | None  # app.types.CacheSource (None: a turn from before migration 0011)
    reason: str  # app.types.ReuseReason
    tokens: int
    at: datetime


@dataclass(frozen=True, slots=True)
class StatusReport:
    url: str
    health: dict[str, Any] | None  # None: no server answers at ``url``
    tiers: cache_index.TierCounts  # conversations per tier: the server's count, else the store's with none hot
    disk_bytes: int
    disk_budget_bytes: int
    jobs: list[jobs.JobRunView]
    recent: list[RecentTurn]  # the most recently used conversations' latest turns, newest first


def read_health(url: str, api_key: str = "") -> dict[str, Any] | None:
    """The server's /health document (also when it answers 503: loading, unavailable); with
    the server's ``api_key``, the agents of the prefills in flight are named in it."""
    request = urllib.request.Request(f"{url}/health", headers={"x-api-key": api_key} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        return None


def server_url(settings: Settings) -> str:
    """Where the server of this home answers on this machine: the address the running one
    wrote beside its lock (``serve --port`` included), else the configured one."""
    host, port = serving_address(settings.home) or (settings.host, settings.port)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{port}"


def collect(settings: Settings, url: str) -> StatusReport:
    health = read_health(url, settings.api_key)
    counted = ((health or {}).get("cache") or {}).get("conversations")  # the server counts its memory in
    tiers = cache_index.TierCounts(**counted) if counted else cache_index.TierCounts(0, 0, 0)
    disk, runs, recent = 0, [], []
    if settings.database_url or settings.db_path.exists():  # the server or the worker created and migrated it
        engine = make_engine(settings.db_url)
        try:
            with make_session_factory(engine)() as session:
                if not counted:  # no server, or no cache: nothing is hot
                    tiers = cache_index.count_tiers(session, hot=())
                disk = cache_index.disk_bytes(session)
                runs = jobs.last_runs(session)
                recent = recent_turns(session)
        finally:
            engine.dispose()
    return StatusReport(url, health, tiers, disk, settings.disk_budget_bytes, runs, recent)


def recent_turns(session: Session, limit: int = RECENT_CONVERSATIONS) -> list[RecentTurn]:
    """The ``limit`` most recently used conversations that ran a turn, with that turn's cache."""
    turns = [RecentTurn(agent.id, c.id, c.last_turn.source, c.last_turn.reason, c.last_turn.n_cached,
                        c.last_access_at)
             for agent in overview.agents(session, limit=limit) for c in agent.conversations
             if c.last_turn is not None]
    return sorted(turns, key=lambda turn: turn.at, reverse=True)[:limit]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _utc(value: datetime) -> str:
    return value.replace(tzinfo=UTC).isoformat()  # the store keeps naive UTC times


def format_json(report: StatusReport) -> str:
    return json.dumps(asdict(report), default=_utc, indent=2)


def format_report(report: StatusReport) -> str:
    health = report.health
    lines = []
    if health is None:
        lines.append(f"server   {report.url}: not running")
    else:
        lines.append(f"server   {report.url}: {health.get('status')} (model {health.get('model')}, "
                     f"{health.get('backend')}, BLAS {health.get('blas')}, up {health.get('uptime_s', 0):.0f} s)")
        lines.append(f"queue    {health.get('queue_depth', 0)} waiting, {health.get('active_requests', 0)} active")
        for prefill in health.get("prefilling") or []:
            named = f"{prefill['request_id']} (agent {prefill['agent_id']})" if "request_id" in prefill else "a request"
            lines.append(f"prefill  {named}: {prefill['done_tokens']} of {prefill['total_tokens']} new tokens")
    cache = (health or {}).get("cache") or {}
    if cache:
        lines.append(f"pool     {_mib(cache['pool_bytes'])} of {_mib(cache['pool_budget_bytes'])}, "
                     f"{cache['blocks_in_memory']} blocks in memory")
    tiers = report.tiers
    lines.append(f"caches   {tiers.hot} hot, {tiers.warm} warm, {tiers.cold} cold")
    lines.append(f"disk     {_mib(report.disk_bytes)} of cache files (budget {_mib(report.disk_budget_bytes)})")
    for i, turn in enumerate(report.recent):
        lines.append(f"{'recent' if i == 0 else '':<8} {turn.agent_id}/{turn.conversation_id}: "
                     f"{turn.source or 'unknown'} ({turn.reason}), {turn.tokens:,} tokens cached")
    if not report.jobs:
        lines.append("jobs     none run yet")
    for i, run in enumerate(report.jobs):
        summary = ", ".join(f"{k} {v}" for k, v in run.result.items() if isinstance(v, (int, float, bool)))
        lines.append(f"{'jobs' if i == 0 else '':<8} {run.name:<8} {run.status:<6} "
                     f"{run.started_at:%Y-%m-%d %H:%M:%S} UTC  {summary}")
    return "\n".join(lines)
