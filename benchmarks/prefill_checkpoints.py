"""What storing a long prefill's checkpoints costs: a cold prefill with them off and on.

    .venv/bin/python benchmarks/prefill_checkpoints.py [--model qwen2.5-coder-0.5b] [--tokens 9400] [--every 0 30 10]

One real server per setting of ``prefill_checkpoint_s`` (0: off), one after the other, each
a fresh home: a cold ~9.4K-token request (Claude Code's main request), greedy, one output
token. Reports the time to first token from the request's sending, the checkpoints the log
shows and the tokens the last one stored. Prints a table, writes
benchmarks/results/prefill_checkpoints.json.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.common import http_client, print_table, write_results  # noqa: E402
from benchmarks.interleave import text_of  # noqa: E402
from benchmarks.side_request import model_path  # noqa: E402
from support.servers import start_server, stop_server  # noqa: E402

CHECKPOINT = re.compile(r"prefill checkpoint, (\d+) of (\d+) prompt tokens stored")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model directory or an embedded model's name")
    parser.add_argument("--tokens", type=int, default=9400)
    parser.add_argument("--every", type=float, nargs="+", default=[0, 30, 10], help="prefill_checkpoint_s values")
    args = parser.parse_args()
    model = model_path(args.model)
    rows, runs = [], []
    for every in args.every:
        server = start_server(Path(tempfile.mkdtemp(prefix="semantic-checkpoints-")), model,
                              {"SEMANTIC_PREFILL_CHECKPOINT_S": str(every)}, timeout_s=600)
        try:
            body = {"model": "m", "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": text_of(args.tokens, 2)}]}
            start = time.perf_counter()
            answer = http_client().post(f"{server.url}/v1/messages", json=body, timeout=3600)
            ttft = time.perf_counter() - start
            answer.raise_for_status()
            usage = answer.json()["usage"]
            stored = [int(m[1]) for m in CHECKPOINT.finditer(server.log())]
        finally:
            stop_server(server)
        n_prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
        runs.append({"prefill_checkpoint_s": every, "ttft_s": ttft, "prompt_tokens": n_prompt,
                     "checkpoints": stored})
        rows.append([every or "off", n_prompt, ttft, len(stored), stored[-1] if stored else "-"])
    print_table(["prefill_checkpoint_s", "prompt tokens", "TTFT s", "checkpoints", "last stored"], rows)
    base = runs[0]["ttft_s"]
    for run in runs[1:]:
        print(f"every {run['prefill_checkpoint_s']:g} s: {run['ttft_s'] / base:.3f}x the first row's TTFT")
    path = write_results("prefill_checkpoints", {"args": {**vars(args)}, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
