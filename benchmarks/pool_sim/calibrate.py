"""``--calibrate``: measure here what no other benchmark's results hold.

- The shared tier: ``S3Tier.fetch`` (the code a restoring server runs) against moto's
  ``ThreadedMotoServer`` on loopback: a small object (the per-object latency) and one
  block-sized object (the bandwidth). A remote S3 is slower: ``--s3-latency-ms`` and
  ``--s3-mb-per-s`` model one.
- Optionally (``--calibrate-prefill``) SmolLM2's prefill through the engine's own prefill
  step, in process, cold and after a cached context: a check of the fit from peers.json,
  which the simulation keeps using (it includes the server's per-request overhead).

Written to benchmarks/results/pool_sim_calibration.json, merged with what is there.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.pool_sim.costs import BLOCK_TOKENS, CALIBRATION, fit_prefill


def measure_s3(kv_bytes_per_token: float, rounds: int = 40) -> dict[str, Any]:
    from moto.server import ThreadedMotoServer

    from app.cache.shared_tier import S3Tier

    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "testtest")):
        os.environ.setdefault(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        tier = S3Tier(f"s3://calibration/pool-sim?endpoint=http://{host}:{port}")
        tier.ensure_bucket()
        block = int(BLOCK_TOKENS * kv_bytes_per_token)
        sizes = {"4 KB": 4096, "1 block": block}  # what the tier holds: records (small) and blocks
        runs: dict[str, list[float]] = {name: [] for name in sizes}
        with tempfile.TemporaryDirectory() as tmp:
            for name, size in sizes.items():
                source = Path(tmp) / name
                source.write_bytes(os.urandom(size))
                tier.put(name, source)
            for _ in range(rounds):  # interleaved, so both sizes see the same load on the machine
                for name in sizes:
                    destination = Path(tmp) / "fetched"
                    destination.unlink(missing_ok=True)
                    started = time.perf_counter()
                    tier.fetch(name, destination)
                    runs[name].append(time.perf_counter() - started)
        seconds = {name: statistics.median(times) for name, times in runs.items()}
    finally:
        server.stop()
    bytes_per_s = (block - 4096) / max(seconds["1 block"] - seconds["4 KB"], 1e-6)
    return {"latency_s": seconds["4 KB"], "bytes_per_s": bytes_per_s, "seconds": seconds, "bytes": sizes,
            "how": f"S3Tier.fetch from moto's ThreadedMotoServer on loopback, median of {rounds}: "
                   + ", ".join(f"{name} in {t * 1000:.1f} ms" for name, t in seconds.items())}


def measure_prefill(sizes: tuple[int, ...] = (512, 1024, 2048), warm: int = 256) -> dict[str, Any]:
    """Engine prefill of SmolLM2 in chunks of 256, in process: cold for each size, then
    ``warm`` tokens after the largest."""
    from app.engine.blas import load_fast_blas

    load_fast_blas()
    from app.cache.blocks import to_working_cache
    from app.catalog.registry import ensure_embedded
    from app.engine.batch import prefill
    from app.engine.fidelity import copy_cache, natural_texts
    from app.engine.model import load_model
    from app.settings import load_settings

    import mlx.core as mx

    loaded = load_model("smollm2", ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"), kv_format="q8")
    ids = loaded.tokenizer.encode(natural_texts()["prose"])[:sizes[-1] + warm]
    empty = lambda: to_working_cache([], loaded.n_layers, 0, mx.float32)  # noqa: E731

    def run(cache: Any, start: int, end: int) -> float:
        began = time.perf_counter()
        for at in range(start, end, BLOCK_TOKENS):
            prefill(loaded.model, cache, ids[at:min(end, at + BLOCK_TOKENS)])
        return time.perf_counter() - began

    run(empty(), 0, 16)  # warm-up
    points: list[tuple[int, int, float]] = []
    cache = empty()
    for size in sizes:
        cache = empty()
        points.append((0, size, run(cache, 0, size)))
    points.append((sizes[-1], warm, run(copy_cache(cache, sizes[-1]), sizes[-1], sizes[-1] + warm)))
    overhead, a, b = fit_prefill(points)
    return {"points": [{"cached": c, "new": n, "seconds": s} for c, n, s in points],
            "fit": {"overhead_s": overhead, "prefill_s_per_token": a, "attention_s_per_token2": b},
            "how": "app.engine.batch.prefill in process (no HTTP, no first decode step), chunks of 256"}


def calibrate(results: Path, kv_bytes_per_token: float, with_prefill: bool) -> dict[str, Any]:
    """Measure, merge into the calibration file and write it; returns what it holds."""
    from benchmarks.common import write_results

    path = results / CALIBRATION
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored.pop("machine", None)
    stored["s3"] = measure_s3(kv_bytes_per_token)
    print(f"S3 tier: {stored['s3']['how']}")
    if with_prefill:
        stored["prefill"] = measure_prefill()
        print("engine prefill: " + ", ".join(f"{p['new']} after {p['cached']}: {p['seconds']:.2f} s"
                                             for p in stored["prefill"]["points"]))
    print(f"wrote {write_results(CALIBRATION.removesuffix('.json'), stored)}")
    return stored
