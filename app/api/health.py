"""Operational endpoints: HEAD and GET /, GET /health, GET /v1/models (and the model list it shows)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import falcon

from app import __version__
from app.agents.service import AgentService
from app.api.page_key import KEY_FORM_PATH
from app.api.pages import render
from app.catalog.hf_cache import list_cached
from app.catalog.registry import list_models
from app.engine.blas import blas_in_use
from app.settings import Settings

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface, KVChoice


# Where ``GET /`` points: this server's pages, and the references of the APIs it speaks.
PAGES = {"agents": ("/agents", "the agents: talk to them (streamed), their conversations and caches"),
         "status": ("/status", "the operator page: model, memory, agents and their caches, misses, jobs"),
         "health": ("/health", "health, model and version (JSON)"),
         "metrics": ("/metrics", "Prometheus metrics"),
         "docs": ("/docs", "this server's API reference (as OpenAPI 3.1: /openapi.json)"),
         "openapi": ("/openapi.json", "the OpenAPI 3.1 document of every route"),
         "models": ("/v1/models", "the models a request may name")}
API_DOCS = {"POST /v1/messages": "https://docs.anthropic.com/en/api/messages",
            "POST /v1/chat/completions": "https://platform.openai.com/docs/api-reference/chat",
            "POST /v1/responses": "https://platform.openai.com/docs/api-reference/responses"}


class RootResource:
    """``GET /``: links to the pages and the API references, as a page for a browser and as
    JSON for anything else. Claude Code probes ``HEAD /`` before its first request. With a
    key set (``keyed``), the page has a key form: it lets the browser open the pages."""

    def __init__(self, keyed: bool = False) -> None:
        self._keyed = keyed

    def on_head(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.status = falcon.HTTP_200

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.client_prefers(["application/json", "text/html"]) != "text/html":
            resp.media = {"name": "semantic", "version": __version__, **{k: path for k, (path, _) in PAGES.items()},
                          "api_docs": API_DOCS}
            return
        resp.content_type = "text/html; charset=utf-8"
        resp.text = render("root.html", version=__version__, key_form_path=KEY_FORM_PATH if self._keyed else None,
                           pages=PAGES.values(), api_docs=API_DOCS.items())


class HealthResource:
    def __init__(self, engine: EngineSurface, agents: AgentService, server_id: str) -> None:
        self._engine = engine
        self._agents = agents
        self._server_id = server_id

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        status = self._engine.status()
        resp.status = falcon.HTTP_200 if status.healthy else falcon.HTTP_503
        resp.media = {
            "status": "ok" if status.healthy else "loading" if status.loading else "unavailable",
            "server_id": self._server_id,
            "version": __version__,
            "model": status.model,
            "model_swaps": status.swaps,
            "backend": status.backend,
            "blas": blas_in_use(),
            "dtype": status.dtype,
            "context_length": status.context_length,
            "uptime_s": round(time.time() - self._engine.started_at, 1),
            "queue_depth": status.queue_depth,
            "active_requests": status.n_active,
            "split_cores": status.split_cores,
            "kv_format": _kv_format(status.kv),
            # Without the key (on a server that has one) the prefills in flight are counted, not named.
            "prefilling": [{"request_id": p.request_id, "agent_id": p.agent_id, "done_tokens": p.done,
                            "total_tokens": p.total} if req.context.get("authorized", True)
                           else {"done_tokens": p.done, "total_tokens": p.total} for p in status.prefills],
            "engine": {  # totals since start: batched decode steps and prefill chunks
                "decode_steps": status.counters.decode_steps, "split_steps": status.counters.split_steps,
                "decode_tokens": status.counters.decode_tokens,
                "decode_s": round(status.counters.decode_s, 3), "prefill_tokens": status.counters.prefill_tokens,
                "prefill_s": round(status.counters.prefill_s, 3),
                "by_batch": {str(rows): {"steps": steps, "s": round(status.counters.seconds_by_batch[rows], 3)}
                             for rows, steps in sorted(status.counters.steps_by_batch.items())}},
        }
        if status.cache is not None:
            tiers = self._agents.count_tiers(self._engine.hot_conversations().keys())
            resp.media["cache"] = {
                "reuse": status.cache.enabled,
                "pool_bytes": status.cache.pool_bytes,
                "pool_budget_bytes": status.cache.budget_bytes,
                "blocks_in_memory": status.cache.n_blocks,
                "blocks_free": status.cache.n_free_blocks,
                "agents": {"hot": status.cache.hot_agents},  # agents with a conversation in memory
                "conversations": {"hot": tiers.hot, "warm": tiers.warm, "cold": tiers.cold},  # cache_index.Tier
            }


def _kv_format(kv: KVChoice | None) -> dict | None:
    """The loaded model's stored KV format, why it is used, and what its calibration measured."""
    if kv is None:
        return None
    measured = kv.measured
    return {"name": kv.format.name, "chosen_by": kv.chosen_by, "bytes_vs_fp16": round(kv.format.bytes_vs_fp16, 4),
            "top1_agreement": round(measured.top1_agreement, 4) if measured else None,
            "perplexity_change": round(measured.perplexity_change, 4) if measured else None,
            "kl_mean": round(measured.kl_mean, 5) if measured else None}


def model_entries(settings: Settings, engine: EngineSurface) -> dict[str, tuple[float, str | None]]:
    """The models a request may name: name -> (when it was made, the model it is an alias of or None)."""
    catalog = engine.catalog
    created = {m.name: m.created_at for m in list_models(settings.models_dir) if catalog.servable(m.name)}
    if catalog.any_installed:
        created.update({m.repo_id: m.snapshot.stat().st_mtime for m in list_cached(catalog.hf_cache)})
    for name, path in catalog.paths.items():
        if path.exists():
            created.setdefault(name, path.stat().st_mtime)
    entries: dict[str, tuple[float, str | None]] = {name: (when, None) for name, when in created.items()}
    entries.update({alias: (created.get(target, 0.0), target) for alias, target in catalog.aliases.items()})
    return dict(sorted(entries.items()))


class ModelsResource:
    """Installed models and the aliases of the configuration, in a shape both the
    Anthropic and OpenAI SDKs read."""

    def __init__(self, settings: Settings, engine: EngineSurface) -> None:
        self._settings = settings
        self._engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        served, catalog = self._engine.model, self._engine.catalog
        entries = model_entries(self._settings, self._engine)
        data = [
            {
                "id": name, "type": "model", "object": "model", "display_name": name,
                "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z"),
                "created": int(created), "owned_by": "semantic", "loaded": (alias_of or name) == served.name,
                "default": (alias_of or name) == catalog.default, "alias_of": alias_of,
            }
            for name, (created, alias_of) in sorted(entries.items())
        ]
        resp.media = {"object": "list", "data": data, "has_more": False,
                      "first_id": data[0]["id"], "last_id": data[-1]["id"]}
