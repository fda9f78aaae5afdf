"""Which prefill chunk size is fastest on this machine, cold and after a cached context.

    .venv/bin/python benchmarks/prefill_chunks.py [--chunks 32 64 128 256 512 1024] [--cases 0:1024 1400:256 6000:256]

SmolLM2 in float32 with the engine's own attention (softmax in NumPy on CPU) and
prefill step: for each case CONTEXT:NEW, a cache of CONTEXT tokens of prose is built
once, then NEW more tokens are prefilled in chunks of each size (best of two runs).
The engine prefills a request that is alone in chunks of ``prefill_step_size``
(default 256, ``scheduler.PrefillPolicy``). Prints a table, writes
benchmarks/results/prefill_chunks.json and prefill_chunks.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402

from app.cache.blocks import to_working_cache  # noqa: E402
from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.batch import prefill  # noqa: E402
from app.engine.fidelity import copy_cache, natural_texts  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    parser.add_argument("--cases", nargs="+", default=["0:1024", "1400:256", "6000:256"])
    args = parser.parse_args()
    loaded = load_model("smollm2", ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"), kv_format="q8")
    model, n_layers = loaded.model, loaded.n_layers
    ids = loaded.tokenizer.encode(natural_texts()["prose"] * 4)
    empty = lambda: to_working_cache([], n_layers, 0, mx.float32)  # noqa: E731
    prefill(model, empty(), ids[:16])  # warm up
    results: dict = {"cases": {}}
    rows = []
    for case in args.cases:
        context, new = map(int, case.split(":"))
        base = empty()
        for start in range(0, context, 256):
            prefill(model, base, ids[start:min(context, start + 256)])
        timings = {}
        for chunk in (c for c in args.chunks if c <= max(new, 32)):
            runs = []
            for _ in range(2):
                cache = copy_cache(base, context) if context else empty()
                started = time.perf_counter()
                for start in range(context, context + new, chunk):
                    prefill(model, cache, ids[start:min(context + new, start + chunk)])
                runs.append(time.perf_counter() - started)
            timings[chunk] = min(runs)
            rows.append([context, new, chunk, f"{timings[chunk]:.2f}", f"{new / timings[chunk]:.0f}"])
            print("  ".join(map(str, rows[-1])), file=sys.stderr)
        results["cases"][case] = {"context": context, "new": new, "seconds": timings}
    print_table(["cached", "new", "chunk", "seconds", "tokens/s"], rows)
    print(f"wrote {write_results('prefill_chunks', results)}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for case, r in results["cases"].items():
        chunks = sorted(r["seconds"])
        ax.plot(chunks, [r["new"] / r["seconds"][c] for c in chunks], marker="o", label=f"{r['new']} new after {r['context']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill chunk (tokens)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    fig.suptitle("SmolLM2 prefill speed by chunk size (float32, CPU)")
    save_plot(fig, "prefill_chunks")


if __name__ == "__main__":
    main()
