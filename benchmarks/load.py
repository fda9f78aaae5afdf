"""A bounded load test: 50 clients at once on loopback, one turn each, and nothing lost.

    .venv/bin/python benchmarks/load.py [--clients 50] [--max-tokens 16]

Every client sends one streamed request (its own agent, a short prompt) at the same
moment against a server with the default limits (8 in the batch, 16 waiting); a 429 is
counted, not retried. The run stops by itself when every client has its answer. Reports
the status counts, TTFT percentiles of the accepted requests, and checks the store:
every accepted request has its history (the question and the reply) and a request row,
no refused one left anything. Prints a table, writes benchmarks/results/load.json.
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


def client(url: str, i: int, max_tokens: int, barrier: threading.Barrier) -> dict:
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
    return {"client": i, "status": status, "ttft_s": ttft, "total_s": time.perf_counter() - start,
            "retry_after": response.headers.get("retry-after")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-load-")), model_dir)
    barrier = threading.Barrier(args.clients)
    results: list[dict] = []
    try:
        threads = [threading.Thread(target=lambda i=i: results.append(client(server.url, i, args.max_tokens, barrier)))
                   for i in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        stop_server(server)
    statuses = Counter(r["status"] for r in results)
    accepted = [r for r in results if r["status"] == 200]
    db = sqlite3.connect(f"file:{server.db_path}?mode=ro", uri=True)
    history = dict(db.execute("SELECT agent_id, count(*) FROM messages GROUP BY agent_id").fetchall())
    rows = dict(db.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
    lost = [r["client"] for r in accepted if history.get(f"load-{r['client']}") != 2]
    leftovers = [r["client"] for r in results if r["status"] != 200 and history.get(f"load-{r['client']}")]
    ttfts = sorted(r["ttft_s"] for r in accepted if r["ttft_s"] is not None)
    p50 = statistics.median(ttfts)
    p95 = statistics.quantiles(ttfts, n=100, method="inclusive")[94] if len(ttfts) > 1 else ttfts[0]
    print_table(["clients", "200", "429", "other", "wall s", "TTFT p50 s", "TTFT p95 s", "history lost",
                 "refused with history"],
                [[args.clients, statuses[200], statuses[429], sum(n for s, n in statuses.items() if s not in (200, 429)),
                  wall, p50, p95, len(lost), len(leftovers)]])
    print("request rows by status:", json.dumps(rows))
    path = write_results("load", {"args": vars(args), "statuses": dict(statuses), "wall_s": wall, "ttft_p50_s": p50,
                                  "ttft_p95_s": p95, "request_rows": rows, "lost_history": lost,
                                  "refused_with_history": leftovers,
                                  "retry_after": sorted({r["retry_after"] for r in results if r["retry_after"]})})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
