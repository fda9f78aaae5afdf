"""Where a forward pass of a few tokens on a long cache goes, per attention path.

    python benchmarks/device/shapes.py MODEL_DIR [--context 8192] [--passes 4] [--json PATH]

What GPU run 3 left open (docs/benchmarks.md, "On a GPU"): on an H200, drafts made decode 3.6x
slower (~70 ms a step where a step without drafts took ~10 ms), and a short turn's 20-105 new
tokens took 221-232 ms of prefill. The hypothesis, read in mlx-cuda's source: its attention for
more than one query uses cuDNN, whose graph it builds and caches per exact shape, the key length
included, so a pass of a few tokens at a cache length not seen before pays a graph build.

This tests it on one cache of ``--context`` random tokens, for passes of T tokens (T = 1, 2, 5, 9,
20, 105, 2048):

- ``new length``: ``--passes`` passes one after another, the cache growing by T each time, so
  every key length is new (then cut back to the context);
- ``same length``: ``--passes`` passes at one length, the cache cut back after each, so after
  the first the shape is one seen before;

each with mlx-lm's attention (``mlx``) and with attention by matmuls (``matmul``: the query heads
that share a key/value head are the rows of one matmul, the softmax in float32; no cuDNN). A
graph build shows as ``new length`` far above ``same length`` on ``mlx`` and not on ``matmul``.
Also the largest difference between the two paths' logits. Prints a table and one JSON line
(also to ``--json``); seconds are medians of the passes, ``first`` the first pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

QUERIES = (1, 2, 5, 9, 20, 105, 2048)
PREFILL_STEP = 2048


def matmul_attention(plain: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``plain`` (mlx-lm's ``scaled_dot_product_attention``) computed by matmuls for a causal
    or unmasked pass over a plain cache; ``plain`` itself otherwise."""

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: Any = None) -> mx.array:
        batch, heads, n_queries, dim = queries.shape
        kv_heads, n_keys = keys.shape[1], keys.shape[2]
        if sinks is not None or hasattr(cache, "bits") or heads % kv_heads or isinstance(mask, mx.array):
            return plain(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        per_kv = heads // kv_heads
        scores = (queries * scale).reshape(batch, kv_heads, per_kv * n_queries, dim) @ keys.swapaxes(-1, -2)
        scores = scores.astype(mx.float32).reshape(batch, kv_heads, per_kv, n_queries, n_keys)
        if mask is not None and n_queries > 1:  # "causal": each query sees the keys up to its own position
            allowed = mx.arange(n_keys)[None, :] <= mx.arange(n_queries)[:, None] + (n_keys - n_queries)
            scores = mx.where(allowed, scores, mx.array(-mx.inf, dtype=mx.float32))
        weights = mx.softmax(scores, axis=-1).astype(values.dtype).reshape(batch, kv_heads, per_kv * n_queries, n_keys)
        return (weights @ values).reshape(batch, heads, n_queries, -1)

    return attention


def attention_module(model: Any) -> Any:
    """The module whose ``scaled_dot_product_attention`` the model's attention layers call."""
    return sys.modules[type(model.layers[0].self_attn).__module__]


def forward(model: Any, cache: list[Any], n_tokens: int, vocab: int) -> tuple[float, mx.array]:
    tokens = mx.random.randint(0, vocab, (1, n_tokens))
    mx.eval(tokens)
    start = time.perf_counter()
    logits = model(tokens, cache=cache)
    mx.eval(logits, [layer.state for layer in cache])
    return time.perf_counter() - start, logits


def trim(cache: list[Any], n: int) -> None:
    for layer in cache:
        layer.trim(n)


def measure(model: Any, cache: list[Any], vocab: int, passes: int, path: str,
            queries: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in queries:
        count = min(passes, 2) if n >= PREFILL_STEP else passes
        new = []
        for _ in range(count):
            new.append(forward(model, cache, n, vocab)[0])
        trim(cache, n * count)
        same = []
        for _ in range(count + 1):
            same.append(forward(model, cache, n, vocab)[0])
            trim(cache, n)
        rows.append({"path": path, "queries": n, "new_length_s": statistics.median(new), "new_first_s": new[0],
                     "same_length_s": statistics.median(same[1:]), "same_first_s": same[0]})
        print(f"{path:>7} T={n:<5} new length {rows[-1]['new_length_s'] * 1e3:9.2f} ms (first "
              f"{new[0] * 1e3:9.2f})   same length {rows[-1]['same_length_s'] * 1e3:9.2f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--queries", type=int, nargs="+", default=list(QUERIES), help="the values of T")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    model, _ = load(args.model_dir)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # as the server computes on a CPU (bfloat16 has no fast path there)
    vocab = int(model.args.vocab_size)
    mx.random.seed(0)
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for begin in range(0, args.context, PREFILL_STEP):
        forward(model, cache, min(PREFILL_STEP, args.context - begin), vocab)
    print(f"{mx.default_device()}: a {args.context}-token cache in {time.perf_counter() - start:.2f} s", flush=True)

    module = attention_module(model)
    plain = module.scaled_dot_product_attention
    tokens = mx.random.randint(0, vocab, (1, 9))
    logits = {}
    for path, fn in (("mlx", plain), ("matmul", matmul_attention(plain))):
        module.scaled_dot_product_attention = fn
        logits[path] = model(tokens, cache=cache).astype(mx.float32)
        mx.eval(logits[path])
        trim(cache, 9)
    difference = mx.abs(logits["mlx"] - logits["matmul"]).max().item()
    print(f"largest logit difference between the paths (9 tokens): {difference:.4g}", flush=True)
    rows = []
    for path, fn in (("mlx", plain), ("matmul", matmul_attention(plain))):
        module.scaled_dot_product_attention = fn
        rows += measure(model, cache, vocab, args.passes, path, args.queries)
    module.scaled_dot_product_attention = plain
    result = json.dumps({"device": str(mx.default_device()), "model": str(args.model_dir), "context": args.context,
                         "logit_difference": difference, "rows": rows})
    print(result)
    if args.json:
        args.json.write_text(result + "\n")


if __name__ == "__main__":
    main()
