"""Workload 6: the same multi-turn agent against Semantic and against mlx_lm.server.

    .venv/bin/python benchmarks/peer.py [--turns 10] [--turn-words 200]

Both servers load the same imported SmolLM2 directory (float32), bind to the
same OpenBLAS (mlx_lm.server through LD_PRELOAD) and get the same client: an
OpenAI chat conversation, streamed, greedy, 16-token replies, each server
continuing its own conversation as a real client would. TTFT is the time to
the first content delta. After the last turn both servers are restarted and
the conversation takes one more turn. Prints a table, writes
benchmarks/results/peer.json and peer.png.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.blas import find_openblas  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import openai_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.multi_turn import user_message  # noqa: E402
from conftest import free_port, start_server, stop_server  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer each message with one short sentence."}


# mlx_lm.server's name for the model given by --model (any other name is loaded as a path
# or a hub repository); Semantic serves any name with its model.
MLX_LM_MODEL = "default_model"


def stream_turn(url: str, messages: list[dict], extra: dict) -> tuple[float, str]:
    """(seconds to the first content delta, reply text) of one streamed chat completion."""
    body = {"model": MLX_LM_MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    ttft, text, _ = openai_stream(f"{url}/v1/chat/completions", body)
    return ttft, text


class MlxLmServer:
    """``mlx_lm server`` as a process, on OpenBLAS like Semantic."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        blas = find_openblas()
        env = {**os.environ, **({"LD_PRELOAD": str(blas)} if blas else {})}
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", self.url.rsplit(":", 1)[1],
             "--temp", "0", "--max-tokens", "16"], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.5)
        raise RuntimeError(f"mlx_lm.server did not start; see {log_path}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


def converse(url: str, history: list[dict], rng: random.Random, turns: int, words: int,
             extra: dict) -> list[float]:
    ttfts = []
    for _ in range(turns):
        history.append({"role": "user", "content": user_message(rng, words)})
        ttft, reply = stream_turn(url, history, extra)
        history.append({"role": "assistant", "content": reply})
        ttfts.append(ttft)
    return ttfts


def run(name: str, start: Callable[[], tuple[str, Callable[[], None]]], args: argparse.Namespace,
        extra: dict) -> dict:
    """The conversation on one server, then one more turn after restarting it."""
    rng = random.Random(7)
    history: list[dict] = [SYSTEM]
    url, stop = start()
    try:
        ttfts = converse(url, history, rng, args.turns, args.turn_words, extra)
    finally:
        stop()
    print(f"{name}: restarting", file=sys.stderr)
    url, stop = start()
    try:
        after_restart = converse(url, history, rng, 1, args.turn_words, extra)[0]
    finally:
        stop()
    return {"ttft_s": ttfts, "after_restart_s": after_restart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-words", type=int, default=200, help="words per user message (~1.2 tokens each)")
    args = parser.parse_args()

    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    scratch = Path(tempfile.mkdtemp(prefix="semantic-peer-"))

    def semantic() -> tuple[str, Callable[[], None]]:
        server = start_server(scratch / "semantic", model_dir)
        return server.url, lambda: stop_server(server)

    def mlx_lm() -> tuple[str, Callable[[], None]]:
        server = MlxLmServer(model_dir, scratch / "mlx_lm.log")
        return server.url, server.stop

    results = {"semantic": run("semantic", semantic, args, {"session_id": "peer-bench"}),
               "mlx_lm.server": run("mlx_lm.server", mlx_lm, args, {"model": "default_model"})}

    ours, theirs = results["semantic"]["ttft_s"], results["mlx_lm.server"]["ttft_s"]
    rows = [[turn + 1, a, b, b / a] for turn, (a, b) in enumerate(zip(ours, theirs))]
    rows.append(["restart", results["semantic"]["after_restart_s"], results["mlx_lm.server"]["after_restart_s"],
                 results["mlx_lm.server"]["after_restart_s"] / results["semantic"]["after_restart_s"]])
    print_table(["turn", "semantic TTFT s", "mlx_lm.server TTFT s", "mlx_lm/semantic"], rows)
    print(f"wrote {write_results('peer', {'args': vars(args), 'servers': results})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, result in results.items():
        ax.plot(range(1, args.turns + 2), [*result["ttft_s"], result["after_restart_s"]], "o-", label=name)
    ax.axvline(args.turns + 0.5, color="gray", linestyle=":")
    ax.text(args.turns + 0.6, ax.get_ylim()[1] * 0.9, "restart", color="gray")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.legend()
    ax.set_title("Multi-turn agent vs mlx_lm.server, SmolLM2-135M, 2-core CPU")
    save_plot(fig, "peer")


if __name__ == "__main__":
    main()
