"""A hot agent's short turn while another agent cold-prefills 6K tokens: does it wait?

    .venv/bin/python benchmarks/interleave.py [--cold-tokens 6000] [--hot-tokens 3000]

One real server, greedy. The hot agent holds a ~3K-token conversation in cache; its
short turns (+~20 tokens, 8-token replies) are timed alone, then three times while a
cold agent's ~6K-token prompt is being prefilled (the engine prefills the shortest
prompt first, in chunks of about 0.25 s, and decodes between chunks). Prints a table,
writes benchmarks/results/interleave.json and interleave.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.catalog.registry import ensure_embedded  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import anthropic_stream, print_table, pyplot, save_plot, write_results  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402

WORDS = ("river", "stone", "lantern", "orchard", "harbor", "meadow", "copper", "willow", "signal", "canyon")


def text_of(n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of text no other prompt here shares."""
    words = [f"{WORDS[(i * 7 + seed) % len(WORDS)]}{(i * 31 + seed * 17) % 997}" for i in range(n_tokens // 4)]
    return " ".join(words)


def turn(url: str, session: str, system: str, history: list[dict], question: str) -> float:
    history.append({"role": "user", "content": question})
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "system": system, "messages": history}
    ttft, text, _ = anthropic_stream(f"{url}/v1/messages", body, {"x-session-id": session})
    history.append({"role": "assistant", "content": text or "ok"})
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-tokens", type=int, default=6000)
    parser.add_argument("--hot-tokens", type=int, default=3000)
    args = parser.parse_args()
    model_dir = ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct")
    server = start_server(Path(tempfile.mkdtemp(prefix="semantic-interleave-")), model_dir)
    hot_system, history = text_of(args.hot_tokens, 1), []
    questions = iter(f"Short question number {i}: which word came first?" for i in range(100))
    try:
        turn(server.url, "hot", hot_system, history, next(questions))  # cold, once: the hot agent's cache
        alone = [turn(server.url, "hot", hot_system, history, next(questions)) for _ in range(3)]
        cold: dict[str, float] = {}

        def cold_agent() -> None:
            start = time.perf_counter()
            body = {"model": "m", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": text_of(args.cold_tokens, 2)}]}
            cold["ttft_s"], _, usage = anthropic_stream(f"{server.url}/v1/messages", body, {"x-session-id": "cold"})
            cold["prompt_tokens"] = usage["input_tokens"] + usage["cache_creation_input_tokens"]
            cold["total_s"] = time.perf_counter() - start

        thread = threading.Thread(target=cold_agent)
        thread.start()
        contended = []
        for delay in (3, 20, 20):
            time.sleep(delay)
            contended.append(turn(server.url, "hot", hot_system, history, next(questions)))
        thread.join()
    finally:
        stop_server(server)
    alone_p50, contended_p50 = statistics.median(alone), statistics.median(contended)
    rows = [["alone", *alone, alone_p50], ["during the cold prefill", *contended, contended_p50]]
    print_table(["hot agent's short turn", "TTFT 1", "TTFT 2", "TTFT 3", "median"], rows)
    print(f"contended/alone (median): {contended_p50 / alone_p50:.2f}x, worst {max(contended) / alone_p50:.2f}x; "
          f"the cold agent's {cold['prompt_tokens']} tokens: TTFT {cold['ttft_s']:.1f} s")
    path = write_results("interleave", {"args": vars(args), "alone_ttft_s": alone, "contended_ttft_s": contended,
                                        "ratio_median": contended_p50 / alone_p50,
                                        "ratio_worst": max(contended) / alone_p50, "cold": cold})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(["alone"] * 3, alone, alpha=0.5)
        ax.bar(["during a cold 6K prefill"] * 3, contended, alpha=0.5)
        ax.scatter(["alone"] * 3 + ["during a cold 6K prefill"] * 3, alone + contended, color="black", zorder=3)
        ax.set_ylabel("TTFT (s)")
        ax.set_title("A hot agent's short turn (SmolLM2-135M, 2-core CPU)")
        save_plot(fig, "interleave")


if __name__ == "__main__":
    main()
