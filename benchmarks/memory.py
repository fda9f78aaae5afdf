"""Workload 5: bytes per cached token, 4-bit blocks vs FP16, and agents that fit.

    .venv/bin/python benchmarks/memory.py [--tokens 2048] [--budget-gib 2]

Fills real cache blocks from SmolLM2 (a real prefill, quantized by the same
code the server uses) and measures them twice: the arrays' sizes, and the
memory MLX really holds for them (``mx.get_active_memory()`` before and after,
the float working cache measured the same way). Prints a table, writes
benchmarks/results/memory.json and memory.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas()

import mlx.core as mx  # noqa: E402

from app.cache.blocks import BLOCK_TOKENS, quantize_span, slice_block, to_working_cache  # noqa: E402
from app.catalog.registry import ensure_embedded  # noqa: E402
from app.engine.model import load_model  # noqa: E402
from app.settings import load_settings  # noqa: E402
from benchmarks.common import print_table, pyplot, save_plot, write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--context", type=int, default=4096, help="tokens per agent for the 'agents that fit' column")
    args = parser.parse_args()

    loaded = load_model("smollm2", ensure_embedded(load_settings().models_dir, "smollm2-135m-instruct"))
    text = " ".join(f"The value of item {i} is {i * 7 % 13}." for i in range(args.tokens))
    tokens = loaded.tokenizer.encode(text)[:args.tokens]
    mx.clear_cache()
    before_float = mx.get_active_memory()
    cache = to_working_cache([], loaded.n_layers, 0, mx.float32)
    for start in range(0, len(tokens), 256):
        mx.eval(loaded.model(mx.array([tokens[start:start + 256]]), cache=cache))
    mx.clear_cache()
    float_measured = (mx.get_active_memory() - before_float) / len(tokens)
    before_blocks = mx.get_active_memory()
    stored = quantize_span(cache, 0, len(tokens))  # as a turn is stored; its full blocks hold no float16 keys
    blocks = [slice_block(stored, s, s + BLOCK_TOKENS) for s in range(0, stored.n_grouped - BLOCK_TOKENS + 1, BLOCK_TOKENS)]
    del stored
    mx.clear_cache()
    n_cached = len(blocks) * BLOCK_TOKENS
    q4_active = (mx.get_active_memory() - before_blocks) / n_cached
    q4_per_token = sum(b.nbytes for b in blocks) / n_cached
    layer = cache[0]
    values_per_token = loaded.n_layers * 2 * layer.keys.shape[1] * layer.keys.shape[3]
    fp16_per_token = values_per_token * 2
    fp32_per_token = values_per_token * 4
    theory = 0.28125  # per 64 values: 32 B packed + 2 B scale + 2 B bias, against 128 B
    budget = args.budget_gib * 1024**3
    rows = [
        ["float32 working copy (MLX active memory)", float_measured, float_measured / fp16_per_token,
         int(budget // (float_measured * args.context))],
        ["float32 (computed)", fp32_per_token, fp32_per_token / fp16_per_token, int(budget // (fp32_per_token * args.context))],
        ["float16 (computed)", fp16_per_token, 1.0, int(budget // (fp16_per_token * args.context))],
        ["4-bit g64 blocks (MLX active memory)", q4_active, q4_active / fp16_per_token,
         int(budget // (q4_active * args.context))],
        ["4-bit g64 blocks (array sizes)", q4_per_token, q4_per_token / fp16_per_token,
         int(budget // (q4_per_token * args.context))],
        ["4-bit g64 (theory)", fp16_per_token * theory, theory, int(budget // (fp16_per_token * theory * args.context))],
    ]
    print(f"SmolLM2-135M: {loaded.n_layers} layers x K,V x {layer.keys.shape[1]} KV heads x {layer.keys.shape[3]} dims "
          f"= {values_per_token} values per token; {n_cached} tokens in {len(blocks)} blocks")
    print_table(["format", "bytes/token", "vs FP16", f"agents of {args.context} tokens in {args.budget_gib:g} GiB"], rows)
    deviation = q4_per_token / (fp16_per_token * theory) - 1
    print(f"measured 4-bit size is {100 * q4_per_token / fp16_per_token:.2f}% of FP16 "
          f"({100 * deviation:+.2f}% from the 28.1% figure)")
    path = write_results("memory", {
        "tokens": n_cached, "bytes_per_token": {"fp32": fp32_per_token, "fp16": fp16_per_token, "q4_arrays": q4_per_token,
                                                "q4_active_memory": q4_active, "fp32_active_memory": float_measured},
        "q4_vs_fp16": q4_per_token / fp16_per_token, "deviation_from_theory": deviation,
        "agents_that_fit": {r[0]: r[3] for r in rows}, "budget_gib": args.budget_gib, "context": args.context})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r[0] for r in rows], [r[1] / 1024 for r in rows],
           color=["tab:gray", "tab:gray", "tab:blue", "tab:green", "tab:green", "tab:olive"])
    ax.set_ylabel("KiB per cached token")
    ax.set_title("SmolLM2-135M KV cache size per token")
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    save_plot(fig, "memory")


if __name__ == "__main__":
    main()
