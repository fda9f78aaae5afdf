"""Shared helpers for benchmark scripts: machine facts, result files, plots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    # SEMANTIC_COMMIT names it where the tree is a copy without its .git (a device machine).
    commit = os.environ.get("SEMANTIC_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "commit": commit,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def device() -> dict[str, Any]:
    """The device MLX computes on here, as a fresh process sees it (``mx.default_device()``),
    and its name: the GPU's from nvidia-smi (or the Mac's chip), else the CPU's model name."""
    probe = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
                           capture_output=True, text=True, timeout=300)
    mlx_device = probe.stdout.strip() or f"none: {probe.stderr.strip()[-300:]}"
    name = ""
    if "gpu" in mlx_device:
        name = _output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if not name and platform.system() == "Darwin":
        name = _output(["sysctl", "-n", "machdep.cpu.brand_string"])
    if not name:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                         if line.startswith("model name")), "")
        except OSError:
            pass
    return {"mlx_device": mlx_device, "name": name or platform.processor() or platform.machine()}


def _output(argv: list[str]) -> str:
    """The first line ``argv`` prints, or "" (not installed, failed)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""


def write_results(name: str, results: dict[str, Any], directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=2))
    return path


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot with a file-only backend, or None (the bench extra is not installed)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, name: str, directory: Path = RESULTS) -> None:  # type: ignore[no-untyped-def]
    """Write ``fig`` as NAME.png in ``directory`` (benchmarks/results)."""
    fig.tight_layout()
    fig.savefig(directory / f"{name}.png", dpi=100)
    print(f"wrote {directory / f'{name}.png'}")


_local = threading.local()


def http_client() -> httpx.Client:
    """This thread's HTTP client, made on first use and kept, as an SDK or a CLI keeps one.

    A streamed turn's clock starts after the client exists: ``httpx.stream`` makes a client
    per request (an SSL context and a connection pool), 30-60 ms on the 2-core CPU that the
    server never sees, which made the client's time to first token 10-17% above the
    server's on short warm turns (docs/benchmarks.md, "On a GPU")."""
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=8))
    return client


def anthropic_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                     response_headers: dict[str, str] | None = None) -> tuple[float, str, dict]:
    """POST a streaming Anthropic-shaped request (``/v1/messages``, an agent's
    ``generate``): (seconds to the first content delta, reply text, final usage).
    ``response_headers``, if given, receives the response's headers.

    Raises:
        RuntimeError: the answer is not a 200 (with its body).
    """
    client = http_client()
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    with client.stream("POST", url, json={**body, "stream": True}, timeout=900, headers=headers) as response:
        if response_headers is not None:
            response_headers.update(response.headers)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "message_start":
                usage.update(event["message"]["usage"])
            elif event["type"] == "content_block_delta":
                ttft = ttft or time.perf_counter() - start
                text.append(event["delta"].get("text", ""))
            elif event["type"] == "message_delta":
                usage.update(event["usage"])
    return ttft or time.perf_counter() - start, "".join(text), usage


@dataclass(frozen=True)
class StreamTimes:
    """One streamed reply, timed by the client from its request: the first content delta,
    the last one, and the stream's end (what an agent waits for before its next step)."""

    ttft_s: float
    last_token_s: float
    end_s: float
    text: str
    usage: dict

    @property
    def close_gap_s(self) -> float:
        """From the reply's last text to the end of the stream."""
        return self.end_s - self.last_token_s


def openai_stream_timed(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                        response_headers: dict[str, str] | None = None) -> StreamTimes:
    """POST a streaming chat completion to ``url`` and time it (``StreamTimes``).
    ``response_headers``, if given, receives the response's headers.

    Raises:
        httpx.HTTPStatusError: the answer is not a 2xx.
    """
    client = http_client()
    start = time.perf_counter()
    ttft = last = None
    text: list[str] = []
    usage: dict = {}
    with client.stream("POST", url, json={**body, "stream": True}, timeout=1800, headers=headers) as response:
        if response_headers is not None:
            response_headers.update(response.headers)
        if response.is_error:
            response.read()
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage.update(chunk.get("usage") or {})
            for choice in chunk.get("choices") or []:
                if choice.get("delta", {}).get("content"):
                    last = time.perf_counter() - start
                    ttft = ttft or last
                    text.append(choice["delta"]["content"])
    end = time.perf_counter() - start
    return StreamTimes(ttft or end, last or end, end, "".join(text), usage)


def openai_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[float, str, dict]:
    """POST a streaming chat completion to ``url``: (seconds to the first content
    delta, reply text, usage if the server sent it)."""
    times = openai_stream_timed(url, body, headers)
    return times.ttft_s, times.text, times.usage


def generation_speed(loaded: Any, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    """Greedy prefill of ``prompt_tokens`` (256-token steps) then ``gen_tokens`` decode steps
    of a loaded model, in process: prompt and generation tokens per second."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    text = " ".join(f"word{i}" for i in range(prompt_tokens))
    prompt = loaded.tokenizer.encode(text)[:prompt_tokens]
    mx.eval(loaded.model(mx.array([prompt[:8]]), cache=make_prompt_cache(loaded.model)))  # warm-up
    start = time.perf_counter()
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=gen_tokens,
                          sampler=lambda lp: mx.argmax(lp, axis=-1), prefill_step_size=256,
                          prompt_cache=make_prompt_cache(loaded.model))
    first = None
    for n, _ in enumerate(steps):
        if n == 0:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"prompt_tokens": len(prompt), "prefill_s": first - start,
            "prompt_tps": len(prompt) / (first - start), "gen_tps": (gen_tokens - 1) / (end - first)}
