"""GET /metrics: Prometheus text format, from a registry owned by the app (not global):
Semantic's own series, its build, and the standard process and Python ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import falcon
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from app import __version__
from app.types import Finished

if TYPE_CHECKING:
    from app.engine.surface import EngineSurface

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TTFT_PART_BUCKETS = (0.001, 0.005, 0.01, 0.025, *TTFT_BUCKETS)  # a part may be next to nothing
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


JobCounts = Callable[[], Sequence[tuple[str, str, int]]]


class JobRunsCollector(Collector):
    """Worker job runs, counted from the ``job_runs`` table at scrape time
    (the worker is another process; the database is what both share)."""

    def __init__(self, counts: JobCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("semantic_job_runs", "Worker job runs by job and status", labels=["job", "status"])
        for name, status, n in self._counts():
            family.add_metric([name, status], n)
        yield family


class Metrics:
    """Counters and histograms the generation endpoints feed, and gauges read at scrape time."""

    def __init__(self, engine: EngineSurface, job_counts: JobCounts) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(JobRunsCollector(job_counts))
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
            r.register(standard)
        Gauge("semantic_build_info", "The running version of Semantic (always 1)", ["version"],
              registry=r).labels(__version__).set(1)
        self.requests = Counter("semantic_requests", "Generation requests by protocol and outcome",
                                ["protocol", "status"], registry=r)
        self.prompt_tokens = Counter("semantic_prompt_tokens", "Prompt tokens, cached ones included", registry=r)
        self.cache_read_tokens = Counter("semantic_cache_read_tokens", "Prompt tokens reused from a cache", registry=r)
        self.output_tokens = Counter("semantic_output_tokens", "Generated tokens", registry=r)
        self.draft_tokens = Counter("semantic_draft_tokens", "Speculative draft tokens proposed", registry=r)
        self.draft_accepted_tokens = Counter("semantic_draft_accepted_tokens",
                                             "Speculative draft tokens the model agreed with (kept)", registry=r)
        self.reuse_reasons = Counter("semantic_cache_reuse_reasons", "How cache reuse ended, by reason "
                                     "(app.types.ReuseReason: extend, exact, diverge, sibling, shared, miss, off)",
                                     ["reason"], registry=r)
        self.ttft = Histogram("semantic_ttft_seconds", "Time to first token, from the request's arrival",
                              buckets=TTFT_BUCKETS, registry=r)
        # Its parts (they add up to it): arrival until the engine took the request (reading,
        # rendering, waiting), its cache brought into memory, the prompt's new tokens computed.
        self.ttft_queue, self.ttft_restore, self.ttft_prefill = (
            Histogram(f"semantic_ttft_{part}_seconds", f"Time to first token: {doc}", buckets=TTFT_PART_BUCKETS,
                      registry=r)
            for part, doc in (("queue", "arrival until the engine took the request"),
                              ("restore", "the conversation's cache brought into memory (disk, a pool's tier)"),
                              ("prefill", "the prompt's new tokens computed, until the first token")))
        self.decode_rate = Histogram("semantic_decode_tokens_per_second", "Decode speed per request",
                                     buckets=RATE_BUCKETS, registry=r)
        def cache_value(read: Callable[[Any], float]) -> Callable[[], float]:
            def value() -> float:
                cache = engine.status().cache
                return float(read(cache)) if cache else 0.0
            return value

        cache_gauges: tuple[tuple[str, str, Callable[[Any], float]], ...] = (
            ("semantic_cache_pool_bytes", "KV bytes in memory: 4-bit blocks and the float working copy",
             lambda s: s.pool_bytes),
            ("semantic_cache_pool_budget_bytes", "Memory pool budget", lambda s: s.budget_bytes),
            ("semantic_cache_hot_conversations", "Conversations whose cache is in memory",
             lambda s: s.hot_conversations),
            ("semantic_cache_evictions", "Conversations spilled from memory to disk since start",
             lambda s: s.n_spilled),
        )
        for name, doc, read in cache_gauges:
            Gauge(name, doc, registry=r).set_function(cache_value(read))
        Gauge("semantic_queue_depth", "Requests waiting for the engine", registry=r).set_function(
            lambda: float(engine.status().queue_depth))
        Gauge("semantic_model_swaps", "Models swapped in for requests since start", registry=r).set_function(
            lambda: float(engine.status().swaps))

    def observe(self, protocol: str, finished: Finished) -> None:
        self.requests.labels(protocol, "cancelled" if finished.stop_reason == "cancelled" else "ok").inc()
        self.prompt_tokens.inc(finished.n_prompt_tokens)
        self.cache_read_tokens.inc(finished.n_cached_tokens)
        self.output_tokens.inc(finished.n_output_tokens)
        self.draft_tokens.inc(finished.n_draft_tokens)
        self.draft_accepted_tokens.inc(finished.n_draft_accepted)
        if finished.reuse is not None:
            self.reuse_reasons.labels(finished.reuse.reason).inc()
        if finished.n_output_tokens:
            self.ttft.observe(finished.ttft_s)
            self.ttft_queue.observe(finished.queue_s)
            self.ttft_restore.observe(finished.restore_s)
            self.ttft_prefill.observe(finished.prefill_s)
        decode_s = finished.total_s - finished.ttft_s
        if finished.n_output_tokens > 1 and decode_s > 0:
            self.decode_rate.observe((finished.n_output_tokens - 1) / decode_s)

    def rejected(self, protocol: str) -> None:
        self.requests.labels(protocol, "rejected").inc()


class MetricsResource:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = generate_latest(self._metrics.registry)
