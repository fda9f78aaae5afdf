"""How close a stored KV format keeps a real model to its float KV: the measurement behind
the ``auto`` KV format's calibration, benchmarks/kv_fidelity.py and the fidelity tests.

A prefix is prefilled once in float32, the way the engine does (one ``KVCache`` per
layer, sliding-window layers included, the model masks by window). Each format then
passes that float cache through its quantizer and back, and the continuation is scored
teacher-forced against the float cache's own scores: top-1 agreement, KL divergence,
perplexity of the real next tokens. Every format goes through the product's own code
(``quantize_span`` / ``to_working_cache``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from app.cache.blocks import quantize_span, to_working_cache
from app.cache.checkpoints import CacheLayout, capture
from app.cache.formats import KVFormat
from app.engine.batch import prefill as feed

TEXTS_DIR = Path(__file__).with_name("texts")


def natural_texts() -> dict[str, str]:
    """Long English prose and Python code: the GPL-3 text (shipped with Semantic, as
    Debian ships it) and the running Python's argparse.py."""
    return {"prose": (TEXTS_DIR / "GPL-3").read_text(), "code": Path(argparse.__file__).read_text()}


def prefill(model: nn.Module, tokens: list[int], step: int = 256) -> list[KVCache]:
    """A float working cache of ``tokens``, prefilled as the engine does (no logits computed)."""
    layout = CacheLayout.of(model)  # hybrid models: recurrent layers keep their state, exactly
    cache = layout.assemble(to_working_cache([], layout.n_attention, 0, mx.float32), None)
    for start in range(0, len(tokens), step):
        feed(model, cache, tokens[start:start + step])
    return cache


def copy_cache(cache: list[KVCache], n_tokens: int) -> list[KVCache]:
    """A working cache of its own holding the first ``n_tokens`` of ``cache``'s KV and the
    same recurrent state (hybrid models: the model replaces a state's arrays, never writes
    into them)."""
    layout = CacheLayout.of_cache(cache)
    attention = []
    for layer in layout.attention(cache):
        fresh = KVCache()
        fresh.state = (mx.array(layer.keys[..., :n_tokens, :]), mx.array(layer.values[..., :n_tokens, :]), n_tokens)
        attention.append(fresh)
    return layout.assemble(attention, capture(layout, cache, n_tokens))


def roundtrip(cache: list[KVCache], n_tokens: int, kv_format: KVFormat) -> list[KVCache]:
    """The float cache's first ``n_tokens`` as the model sees them after being stored in
    ``kv_format`` (which stores the KV only: recurrent state stays as it is)."""
    layout = CacheLayout.of_cache(cache)
    attention = layout.attention(cache)
    block = quantize_span(attention, 0, n_tokens, kv_format)
    stored = to_working_cache([block], len(attention), n_tokens, mx.float32, kv_format)
    return layout.assemble(stored, capture(layout, cache, n_tokens))


def continuation_logprobs(model: nn.Module, cache: list[KVCache], tokens: list[int]) -> mx.array:
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


class TeacherForced:
    """One prefix prefilled in float and its continuation's float scores, against which
    any number of formats are then scored (``score``)."""

    def __init__(self, model: nn.Module, tokens: list[int], n_prefix: int) -> None:
        self.model, self.n_prefix = model, n_prefix
        self.base = prefill(model, tokens[:n_prefix])
        rest = tokens[n_prefix:]
        self.inputs, self.targets = rest[:-1], rest[1:]
        self.reference = continuation_logprobs(model, copy_cache(self.base, n_prefix), self.inputs)

    def score(self, kv_format: KVFormat) -> Scores:
        candidate = continuation_logprobs(self.model, roundtrip(self.base, self.n_prefix, kv_format), self.inputs)
        return compare(self.reference, candidate, self.targets)


def teacher_forced(model: nn.Module, tokens: list[int], n_prefix: int,
                   formats: Iterable[KVFormat]) -> dict[str, Scores]:
    """Prefix ``tokens[:n_prefix]`` in float, each format's round trip of it, the rest scored."""
    measure = TeacherForced(model, tokens, n_prefix)
    return {f.name: measure.score(f) for f in formats}
