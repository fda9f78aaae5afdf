"""What a turn costs on one server, from numbers measured on this machine (benchmarks/results/).

Every field of ``Costs`` names, in ``sources``, the result file (and the commit it was
measured at) it comes from. Prefill time is fitted to one conversation's turns, cold and
warm, as ``overhead + a * new + b * new * (cached + new / 2)``: a per-token cost plus
attention over the context, which is what makes a cold re-prefill of a long conversation
on a CPU so much slower than its warm turns.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_TOKENS = 256  # app/cache/hashing.py: the shared tier holds one object per full block
CALIBRATION = "pool_sim_calibration.json"


@dataclass(frozen=True)
class Costs:
    overhead_s: float  # a request's fixed cost to its first token (HTTP, tokenizing, the first decode step)
    prefill_s_per_token: float
    attention_s_per_token2: float  # per new token per token of context
    disk_restore_tokens_per_s: float  # a conversation read back from the server's own disk
    s3_latency_s: float  # one object fetched from the shared tier, before its bytes
    s3_bytes_per_s: float
    kv_bytes_per_token: float  # of the stored (quantized) blocks
    decode_stream_tokens_per_s: float  # one agent's reply
    decode_batch_tokens_per_s: float  # the engine's throughput with several agents decoding at once
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def prefill_s(self, cached: int, new: int) -> float:
        """Seconds to prefill ``new`` tokens after ``cached`` reused ones (the overhead apart)."""
        return new * (self.prefill_s_per_token + self.attention_s_per_token2 * (cached + new / 2))

    def disk_s(self, tokens: int) -> float:
        return tokens / self.disk_restore_tokens_per_s

    def tier_fetch_s(self, tokens: int) -> float:
        """Fetching ``tokens`` worth of blocks and a record from the tier, one object after
        another as ``FileLayout.local`` does."""
        objects = math.ceil(tokens / BLOCK_TOKENS) + 1
        return objects * self.s3_latency_s + tokens * self.kv_bytes_per_token / self.s3_bytes_per_s


def _json(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: the pool simulation takes its costs from it (run its benchmark, "
                                f"or `python -m benchmarks.pool_sim --calibrate` for {CALIBRATION})")
    return json.loads(path.read_text())


def _at(data: dict[str, Any]) -> str:
    return f"commit {data.get('machine', {}).get('commit', '?')}"


def fit_prefill(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(overhead, a, b) of ``seconds = overhead + a * new + b * new * (cached + new / 2)``,
    least squares over (cached, new, seconds) points."""
    rows = np.array([[1.0, new, new * (cached + new / 2)] for cached, new, _ in points])
    solution, *_ = np.linalg.lstsq(rows, np.array([s for *_, s in points]), rcond=None)
    overhead, a, b = (float(x) for x in solution)
    return overhead, a, b


def kv_bytes_per_token(results: Path) -> tuple[float, str]:
    """Bytes a cached token takes in the default KV format (q8), and where that comes from."""
    memory, fidelity = _json(results, "memory.json"), _json(results, "kv_fidelity.json")
    return (memory["bytes_per_token"]["fp16"] * fidelity["formats"]["q8"]["bytes_vs_fp16"],
            f"memory.json ({_at(memory)}) FP16 bytes x kv_fidelity.json ({_at(fidelity)}) q8 ratio")


def load_costs(results: Path) -> Costs:
    """The costs from the result files in ``results`` (benchmarks/results/).

    Raises:
        FileNotFoundError: a result file is missing (its message names the benchmark to run).
    """
    peers = _json(results, "peers.json")
    turns = {t["turn"]: t for t in peers["servers"]["semantic"]["turns"]}
    warm_and_cold = [(t["cached_tokens"], t["prompt_tokens"] - t["cached_tokens"], t["ttft_s"])
                     for label, t in turns.items() if not label.startswith("after")]
    overhead, a, b = fit_prefill(warm_and_cold)
    # The same short turn, hot and after a SIGKILL and restart: the difference is reading the
    # conversation back from disk (the restarted server may have begun its prefetch: an upper bound).
    hot, killed = turns["17 short"], turns["after SIGKILL"]
    disk_tps = killed["cached_tokens"] / (killed["ttft_s"] - hot["ttft_s"])
    kv_bytes, kv_source = kv_bytes_per_token(results)
    concurrency = _json(results, "concurrency.json")
    batched = max((level for level in concurrency["levels"] if level["server"] == "split"), key=lambda l: l["agents"])
    s3 = _json(results, CALIBRATION)["s3"]
    peers_at = f"peers.json ({_at(peers)})"
    return Costs(
        overhead_s=overhead, prefill_s_per_token=a, attention_s_per_token2=b, disk_restore_tokens_per_s=disk_tps,
        s3_latency_s=s3["latency_s"], s3_bytes_per_s=s3["bytes_per_s"], kv_bytes_per_token=kv_bytes,
        decode_stream_tokens_per_s=peers["servers"]["semantic"]["decode_tps"],
        decode_batch_tokens_per_s=batched["engine_decode_tokens_per_s"],
        sources={
            "prefill": f"{peers_at}: Semantic's {len(warm_and_cold)} turns (1 cold, the rest warm), TTFT fitted",
            "disk_restore": f"{peers_at}: TTFT after SIGKILL ({killed['cached_tokens']} tokens from disk) "
                            f"minus the hot short turn",
            "s3": f"{CALIBRATION} ({_at(_json(results, CALIBRATION))}): {s3['how']}",
            "kv_bytes_per_token": kv_source,
            "decode_stream": f"{peers_at}: Semantic's decode tok/s",
            "decode_batch": f"concurrency.json ({_at(concurrency)}): engine decode tok/s, "
                            f"{int(batched['agents'])} agents, split",
        })


def with_s3(costs: Costs, latency_s: float | None, bytes_per_s: float | None) -> Costs:
    """``costs`` with the tier's latency or bandwidth replaced (a remote S3 rather than loopback)."""
    sources = dict(costs.sources)
    if latency_s is not None or bytes_per_s is not None:
        sources["s3"] = "given on the command line"
    return replace(costs, s3_latency_s=costs.s3_latency_s if latency_s is None else latency_s,
                   s3_bytes_per_s=costs.s3_bytes_per_s if bytes_per_s is None else bytes_per_s, sources=sources)


def describe(costs: Costs) -> list[list[str]]:
    """Rows (cost, value, source) for the printed table."""
    cold = {n: costs.overhead_s + costs.prefill_s(0, n) for n in (2048, 6144)}
    return [
        ["prefill, cold", f"{2048 / cold[2048]:.0f} tok/s at 2K, {6144 / cold[6144]:.0f} at 6K "
                          f"(overhead {costs.overhead_s:.2f} s)", costs.sources.get("prefill", "")],
        ["prefill, warm", f"{240 / (costs.overhead_s + costs.prefill_s(4096, 240)):.0f} tok/s "
                          f"(240 new after 4K)", costs.sources.get("prefill", "")],
        ["restore from local disk", f"{costs.disk_restore_tokens_per_s:.0f} tok/s",
         costs.sources.get("disk_restore", "")],
        ["S3 tier, per object", f"{costs.s3_latency_s * 1000:.1f} ms, {costs.s3_bytes_per_s / 1e6:.0f} MB/s",
         costs.sources.get("s3", "")],
        ["restore from S3 tier", f"{4096 / (costs.tier_fetch_s(4096) + costs.disk_s(4096)):.0f} tok/s (4K tokens)",
         "fetch, then as from disk"],
        ["KV bytes per token (q8)", f"{costs.kv_bytes_per_token:.0f}", costs.sources.get("kv_bytes_per_token", "")],
        ["decode, one agent", f"{costs.decode_stream_tokens_per_s:.1f} tok/s", costs.sources.get("decode_stream", "")],
        ["decode, batched", f"{costs.decode_batch_tokens_per_s:.1f} tok/s", costs.sources.get("decode_batch", "")],
    ]
