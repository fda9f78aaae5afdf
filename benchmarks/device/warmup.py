"""Compile a model's kernels before timing servers on it, and time that first run.

    python benchmarks/device/warmup.py MODEL_DIR [--tokens 4096] [--json PATH]

MLX on CUDA compiles its kernels on first use and keeps them in a disk cache: the first
requests on a fresh machine pay that (ACCELERATOR.md: a first 8K-token prefill of 77.6 s,
3.8 s on later runs). This runs, in process and twice, what both servers run: a greedy
prefill of ``--tokens`` tokens in 2048-token steps (mlx-lm's default), one in 256-token
steps (Semantic's default), a few decode steps, and the 8-bit KV quantize/dequantize
Semantic stores caches with. Prints one JSON line (and writes it to --json): seconds of
each pass, the first (compiling) and the second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache


def one_pass(model, tokens: list[int], decode_steps: int = 8) -> dict[str, float]:  # type: ignore[no-untyped-def]
    times: dict[str, float] = {}
    for step in (2048, 256):
        start = time.perf_counter()
        prompt = tokens if step == 2048 else tokens[:1024]
        steps = generate_step(mx.array(prompt), model, max_tokens=decode_steps, prefill_step_size=step,
                              sampler=lambda lp: mx.argmax(lp, axis=-1), prompt_cache=make_prompt_cache(model))
        first = None
        for n, _ in enumerate(steps):
            if n == 0:
                first = time.perf_counter()
        assert first is not None
        times[f"prefill_{len(prompt)}_step_{step}_s"] = first - start
        times[f"decode_{decode_steps - 1}_s_after_step_{step}"] = time.perf_counter() - first
    start = time.perf_counter()
    for bits in (8, 4):
        keys = mx.random.normal((1, 8, 512, 128)).astype(mx.bfloat16)
        mx.eval(mx.dequantize(*mx.quantize(keys, group_size=64, bits=bits), group_size=64, bits=bits))
    times["kv_quantize_s"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = load(args.model_dir)
    loaded_s = time.perf_counter() - start
    words = " ".join(f"note{i}" for i in range(args.tokens))
    tokens = tokenizer.encode(words)[: args.tokens]
    first = one_pass(model, tokens)
    second = one_pass(model, tokens)
    result = json.dumps({"device": str(mx.default_device()), "load_s": loaded_s, "prompt_tokens": len(tokens),
                         "first": first, "second": second})
    print(result)
    if args.json:
        args.json.write_text(result + "\n")


if __name__ == "__main__":
    main()
