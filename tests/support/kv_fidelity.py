"""How close a quantized KV cache keeps a real model to its float KV: the measurements
behind benchmarks/kv_fidelity.py and the real-model fidelity tests.

A prefix is prefilled once in float32, the way the engine does (one ``KVCache`` per
layer, sliding-window layers included, the model masks by window). Each format then
passes that float cache through its quantizer and back, and the continuation is scored
teacher-forced against the float cache's own scores: top-1 agreement, KL divergence,
perplexity of the real next tokens. Every format goes through the product's own code
(``quantize_span`` / ``to_working_cache``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from app.cache.blocks import KV_FORMATS, quantize_span, to_working_cache

Roundtrip = Callable[[list[KVCache], int], list[KVCache]]


def _product_format(name: str) -> Roundtrip:
    def roundtrip(cache: list[KVCache], n_tokens: int) -> list[KVCache]:
        block = quantize_span(cache, 0, n_tokens, KV_FORMATS[name])
        return to_working_cache([block], len(cache), n_tokens, mx.float32, KV_FORMATS[name])

    return roundtrip


FORMATS: dict[str, Roundtrip] = {name: _product_format(name) for name in KV_FORMATS}
# Stored bytes per token relative to FP16 keys and values (data plus float16 scale and bias per 64 values).
BYTES_VS_FP16 = {name: f.bytes_per_value / 2 for name, f in KV_FORMATS.items()}


def prefill(model, tokens: list[int], step: int = 256) -> list[KVCache]:  # type: ignore[no-untyped-def]
    cache = to_working_cache([], len(model.layers), 0, mx.float32)
    for start in range(0, len(tokens), step):
        mx.eval(model(mx.array([tokens[start:start + step]]), cache=cache))
    return cache


def copy_cache(cache: list[KVCache], n_tokens: int) -> list[KVCache]:
    out = []
    for layer in cache:
        fresh = KVCache()
        fresh.state = (mx.array(layer.keys[..., :n_tokens, :]), mx.array(layer.values[..., :n_tokens, :]), n_tokens)
        out.append(fresh)
    return out


def continuation_logprobs(model, cache: list[KVCache], tokens: list[int]) -> mx.array:  # type: ignore[no-untyped-def]
    """Log-probabilities at each position of ``tokens`` (teacher-forced), shape (T, vocab)."""
    logits = model(mx.array([tokens]), cache=cache)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


@dataclass(frozen=True, slots=True)
class Scores:
    top1_agreement: float
    kl_mean: float
    kl_max: float
    perplexity: float
    float_perplexity: float

    @property
    def perplexity_change(self) -> float:
        return self.perplexity / self.float_perplexity - 1


def compare(reference: mx.array, candidate: mx.array, targets: list[int]) -> Scores:
    """``reference`` / ``candidate``: (T, vocab) log-probabilities; ``targets[t]`` the real token after position t."""
    kl = mx.sum(mx.exp(reference) * (reference - candidate), axis=-1)
    agree = mx.mean((mx.argmax(reference, axis=-1) == mx.argmax(candidate, axis=-1)).astype(mx.float32))
    index = mx.array(targets)[:, None]
    nll = -mx.take_along_axis(candidate, index, axis=-1).mean()
    float_nll = -mx.take_along_axis(reference, index, axis=-1).mean()
    return Scores(float(agree), float(kl.mean()), float(kl.max()), math.exp(float(nll)), math.exp(float(float_nll)))


def teacher_forced(model, tokens: list[int], n_prefix: int, formats: list[str]) -> dict[str, Scores]:  # type: ignore[no-untyped-def]
    """Prefix ``tokens[:n_prefix]`` in float, each format's round trip of it, the rest scored."""
    base = prefill(model, tokens[:n_prefix])
    rest = tokens[n_prefix:]
    inputs, targets = rest[:-1], rest[1:]
    reference = continuation_logprobs(model, copy_cache(base, n_prefix), inputs)
    return {name: compare(reference, continuation_logprobs(model, FORMATS[name](base, n_prefix), inputs), targets)
            for name in formats}


def greedy(model, cache: list[KVCache], last: int, n_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    out, token = [], last
    for _ in range(n_tokens):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = int(mx.argmax(logits))
        out.append(token)
    return out


def greedy_agreement(model, tokens: list[int], formats: list[str], n_tokens: int = 64) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Greedy tokens after ``tokens`` equal to float KV's, position by position, per format."""
    base = prefill(model, tokens[:-1])
    n = len(tokens) - 1
    reference = greedy(model, copy_cache(base, n), tokens[-1], n_tokens)
    return {name: sum(a == b for a, b in zip(reference, greedy(model, FORMATS[name](base, n), tokens[-1], n_tokens)))
            for name in formats}


def natural_texts() -> dict[str, str]:
    """Long English prose and Python code that ship with Debian and with Python."""
    import argparse

    return {"prose": Path("/usr/share/common-licenses/GPL-3").read_text(),
            "code": Path(argparse.__file__).read_text()}


def needle_prompt(tokenizer, n_filler_tokens: int, secret: str) -> list[int]:  # type: ignore[no-untyped-def]
    """A fact at the start of a long context, asked for at the end, in the chat template."""
    filler_ids = tokenizer.encode(natural_texts()["prose"])[:n_filler_tokens]
    filler = tokenizer.decode(filler_ids)
    messages = [{"role": "user", "content": f"Remember this: the secret passphrase is {secret}.\n\n{filler}\n\n"
                 "What is the secret passphrase? Answer with the passphrase only."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
