"""A bounded load test: 50 clients at once on loopback, one turn each, and nothing lost.

    .venv/bin/python benchmarks/load.py [--clients 50] [--max-tokens 16] [--mix anthropic,ollama,websocket]

Every client sends one streamed request (its own agent, a short prompt) at the same
moment against a server with the default limits (8 in the batch, 16 waiting); a 429 is
counted, not retried. The clients take turns over the protocols of ``--mix``: Anthropic
SSE (``/v1/messages``), Ollama NDJSON (``/api/chat``) and a Responses WebSocket
(``/v1/responses``, ``response.create``). ``/health`` is asked every 0.2 s throughout.
The run stops by itself when every client has its answer. Reports, per protocol, the
status counts and TTFT percentiles of the accepted requests, the ``/health`` latencies
and errors, and checks the store: every accepted request has its history (the question
and the reply) and a request row, no refused one left anything. Prints a table, writes
benchmarks/results/load.json.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import http_client, print_table, write_results  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402


def anthropic_client(url: str, i: int, max_tokens: int, barrier: threading.Barrier) -> dict:
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Client {i}: name a city and a river."}]}
    session = http_client()  # made before the burst, as each client's own would be
    barrier.wait()
    start = time.perf_counter()
    ttft = None
    with session.stream("POST", f"{url}/v1/messages", json=body, headers={"x-session-id": f"load-{i}"},
                        timeout=1800) as response:
        status = response.status_code
        for line in response.iter_lines():
            if line.startswith("event: content_block_delta") and ttft is None:
                ttft = time.perf_counter() - start
    return {"status": status, "ttft_s": ttft, "total_s": time.perf_counter() - start,
            "retry_after": response.headers.get("retry-after")}


def ollama_client(url: str, i: int, max_tokens: int, barrier: threading.Barrier) -> dict:
    body = {"model": "m", "stream": True, "options": {"temperature": 0, "num_predict": max_tokens},
            "session_id": f"load-{i}",
            "messages": [{"role": "user", "content": f"Client {i}: name a city and a river."}]}
    session = http_client()
    barrier.wait()
    start = time.perf_counter()
    ttft = None
    with session.stream("POST", f"{url}/api/chat", json=body, timeout=1800) as response:
        status = response.status_code
        for line in response.iter_lines():
            if line and ttft is None and json.loads(line).get("message", {}).get("content"):
                ttft = time.perf_counter() - start
    return {"status": status, "ttft_s": ttft, "total_s": time.perf_counter() - start,
            "retry_after": response.headers.get("retry-after")}


def websocket_client(url: str, i: int, max_tokens: int, barrier: threading.Barrier) -> dict:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    barrier.wait()
    start = time.perf_counter()
    ttft, status = None, "error"
    try:
        with connect(url.replace("http://", "ws://") + "/v1/responses", open_timeout=60,
                     additional_headers={"x-session-id": f"load-{i}"}) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "m", "max_output_tokens": max_tokens,
                                "temperature": 0, "store": False,
                                "input": f"Client {i}: name a city and a river."}))
            while True:
                event = json.loads(ws.recv(timeout=1800))
                if event["type"] == "response.output_text.delta" and ttft is None:
                    ttft = time.perf_counter() - start
                if event["type"] in ("response.completed", "response.incomplete"):
                    status = 200
                    break
                if event["type"] in ("error", "response.failed"):
                    status = event.get("status") or event.get("error", {}).get("status") or "error"
                    break
    except InvalidStatus as exc:  # the upgrade refused (429 beyond max_websockets)
        status = exc.response.status_code
    return {"status": status, "ttft_s": ttft, "total_s": time.perf_counter() - start, "retry_after": None}


CLIENTS = {"anthropic": anthropic_client, "ollama": ollama_client, "websocket": websocket_client}


def watch_health(url: str, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    """GET /health every 0.2 s until ``stop``: each answer's seconds, or what went wrong."""
    session = http_client()
    while not stop.is_set():
        start = time.perf_counter()
        try:
            answer = session.get(f"{url}/health", timeout=10)
            if answer.status_code != 200:
                errors.append(str(answer.status_code))
            latencies.append(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001  (counted: the server did not answer)
            errors.append(type(exc).__name__)
        stop.wait(0.2)


def percentile(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1] if len(ordered) > 1 else ordered[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mix", default="anthropic,ollama,websocket",
                        help=f"the protocols the clients take turns over, of {', '.join(CLIENTS)}")
    args = parser.parse_args()
    mix = args.mix.split(",")
    if unknown := set(mix) - set(CLIENTS):
        parser.error(f"--mix: unknown protocol(s) {', '.join(sorted(unknown))}")
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-load-")), model_dir)
    barrier = threading.Barrier(args.clients)
    results: list[dict] = []
    stop, health, health_errors = threading.Event(), [], []
    watcher = threading.Thread(target=watch_health, args=(server.url, stop, health, health_errors))
    try:
        watcher.start()

        def run(i: int) -> None:
            protocol = mix[i % len(mix)]
            results.append({"client": i, "protocol": protocol,
                            **CLIENTS[protocol](server.url, i, args.max_tokens, barrier)})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        stop.set()
        watcher.join()
        stop_server(server)
    db = sqlite3.connect(f"file:{server.db_path}?mode=ro", uri=True)
    history = dict(db.execute("SELECT agent_id, count(*) FROM messages GROUP BY agent_id").fetchall())
    rows = dict(db.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
    table, by_protocol = [], {}
    for protocol in mix:
        mine = [r for r in results if r["protocol"] == protocol]
        statuses = Counter(r["status"] for r in mine)
        accepted = [r for r in mine if r["status"] == 200]
        ttfts = [r["ttft_s"] for r in accepted if r["ttft_s"] is not None]
        lost = [r["client"] for r in accepted if history.get(f"load-{r['client']}") != 2]
        leftovers = [r["client"] for r in mine if r["status"] != 200 and history.get(f"load-{r['client']}")]
        by_protocol[protocol] = {"statuses": {str(k): v for k, v in statuses.items()},
                                 "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                                 "ttft_p95_s": percentile(ttfts, 95) if ttfts else None,
                                 "lost_history": lost, "refused_with_history": leftovers}
        table.append([protocol, len(mine), statuses[200], statuses[429],
                      sum(n for k, n in statuses.items() if k not in (200, 429)),
                      by_protocol[protocol]["ttft_p50_s"] or "-", by_protocol[protocol]["ttft_p95_s"] or "-",
                      len(lost), len(leftovers)])
    print_table(["protocol", "clients", "200", "429", "other", "TTFT p50 s", "TTFT p95 s", "history lost",
                 "refused with history"], table)
    health_p95 = percentile(health, 95) if health else None
    print(f"wall {wall:.1f} s; /health: {len(health)} answers, p95 {health_p95 or 0:.3f} s, max "
          f"{max(health, default=0):.3f} s, {len(health_errors)} errors; request rows by status: {json.dumps(rows)}")
    path = write_results("load", {"args": vars(args), "wall_s": wall, "by_protocol": by_protocol,
                                  "health": {"answers": len(health), "p95_s": health_p95,
                                             "max_s": max(health, default=None), "errors": health_errors},
                                  "request_rows": rows,
                                  "retry_after": sorted({r["retry_after"] for r in results if r["retry_after"]})})
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
