"""Plain decode against mlx_lm.server: where a streamed turn's time goes past the model.

    .venv/bin/python benchmarks/decode_gap.py [--servers semantic mlx_lm] [--reply-tokens 96]
        [--prompt-words 1000] [--repeats 3] [--py-spy DIR]

Each server (one after another, both on OpenBLAS as in ``peers.py``) serves SmolLM2 and
gets the same streamed, greedy OpenAI chat request ``--repeats`` times after one warm-up;
Semantic's carries ``speculate: false`` (plain decoding only). Each request gets a new
user message, so every prompt is prefilled cold: the decode measured is the same work on
both servers. Per request: seconds to the first content delta, to the last, to the stream's
end, the decode rate over the deltas after the first, and the median gap between deltas.
``--py-spy DIR`` samples Semantic's server process (every thread, waiting ones too)
during its measured requests into DIR/semantic.txt (py-spy's collapsed stacks; needs
py-spy in the venv). For Semantic it also reads its own decode-step seconds per token
(``/health``'s ``engine`` totals over the measured requests): the rest of a delta's gap is
what the server does around the model (runner loop, channel, SSE, socket). Prints one line per request, one summary line per server, and the
load average before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import http_client  # noqa: E402
from benchmarks.multi_turn import user_message  # noqa: E402
from benchmarks.peers import MLX_LM_MODEL, SCRATCH, end, mlx_lm_server  # noqa: E402
from conftest import start_server  # noqa: E402


def stream(url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed chat completion: arrival time of every content delta, and the end."""
    client = http_client()
    start = time.perf_counter()
    arrivals: list[float] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                arrivals.append(time.perf_counter() - start)
    end_s = time.perf_counter() - start
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": arrivals[0], "last_token_s": arrivals[-1], "total_s": end_s, "deltas": len(arrivals),
            "decode_tps": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0,
            "median_gap_ms": 1000 * statistics.median(gaps) if gaps else 0.0}


def engine_totals(url: str) -> dict[str, float]:
    """Semantic's decode totals since start (``/health``'s ``engine``)."""
    return httpx.get(f"{url}/health", timeout=30).json()["engine"]


def measure(name: str, url: str, model: str, prompts: list[str], reply_tokens: int,
            extra: dict[str, Any]) -> list[dict[str, float]]:
    """The warm-up request, then one measured request per remaining prompt."""
    records = []
    for i, prompt in enumerate(prompts):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": reply_tokens,
                "temperature": 0, **extra}
        record = stream(url, body)
        if i:
            records.append(record)
            print(f"{name:9s} ttft {record['ttft_s']:.2f} s  last {record['last_token_s']:.2f} s  "
                  f"end {record['total_s']:.2f} s  deltas {record['deltas']}  decode {record['decode_tps']:.2f} tok/s"
                  f"  median gap {record['median_gap_ms']:.1f} ms", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=["semantic", "mlx_lm"], default=["semantic", "mlx_lm"])
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument("--prompt-words", type=int, default=1000, help="words of the user message")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--py-spy", type=Path, help="write Semantic's sampled stacks here")
    args = parser.parse_args()
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    rng = random.Random(0)
    prompts = [user_message(rng, args.prompt_words) for _ in range(args.repeats + 1)]
    scratch = SCRATCH / "decode-gap"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    summary = {}
    for name in args.servers:
        if name == "semantic":
            server: Any = start_server(scratch / f"semantic-{time.time_ns()}", model_dir)
            model, extra = "smollm2-135m-instruct", {"speculate": False}
        else:
            server = mlx_lm_server(model_dir, scratch / "mlx_lm.log")
            model, extra = MLX_LM_MODEL, {}
        spy = None
        try:
            if args.py_spy and name == "semantic":
                measure(name, server.url, model, prompts[:1], args.reply_tokens, extra)  # warm before sampling
                args.py_spy.mkdir(parents=True, exist_ok=True)
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw",
                                        "--rate", "200", "--idle", "--threads", "--pid", str(server.process.pid),
                                        "-o", str(args.py_spy / "semantic.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)
            before = engine_totals(server.url) if name == "semantic" else None
            records = measure(name, server.url, model, prompts, args.reply_tokens, extra)
            if before is not None:
                after = engine_totals(server.url)
                step_ms = 1000 * (after["decode_s"] - before["decode_s"]) / (after["decode_tokens"]
                                                                           - before["decode_tokens"])
                print(f"semantic  decode step {step_ms:.1f} ms a token (engine's own timing)", flush=True)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            end(server.process, signal.SIGTERM)
        summary[name] = {key: statistics.median(r[key] for r in records) for key in records[0]}
    for name, median in summary.items():
        print(f"{name:9s} median: decode {median['decode_tps']:.2f} tok/s, gap {median['median_gap_ms']:.1f} ms, "
              f"ttft {median['ttft_s']:.2f} s, last token {median['last_token_s']:.2f} s, "
              f"end {median['total_s']:.2f} s")
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
