"""Exact speculative sampling of prompt-lookup drafts, for temperatures above 0.

A prompt-lookup draft is one token per position, proposed with certainty: its draft
distribution ``q`` is one-hot. The standard acceptance rule (Leviathan et al. 2023;
Chen et al. 2023) accepts draft token ``d`` with probability ``min(1, p(d) / q(d))``,
here ``p(d)``, and on a rejection samples from ``norm(max(0, p - q))``: ``p`` without
``d``, renormalized. Every token handed out is then distributed exactly as sampling
from ``p`` one step at a time would give it. ``p`` is the distribution the request's
sampler draws from (``token_distribution``: temperature, top-p, top-k as mlx-lm's
``make_sampler`` applies them), so drafts change the speed, never the distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

Distribution = Callable[[mx.array], mx.array]


def token_distribution(temperature: float, top_p: float = 1.0, top_k: int = 0) -> Distribution | None:
    """The next-token probabilities ``(rows, vocab)`` from logits ``(rows, vocab)`` that
    ``make_sampler(temp=temperature, top_p=top_p, top_k=top_k)`` samples from (top-p, then
    top-k, then the temperature); None for greedy decoding (``temperature`` 0)."""
    if temperature == 0:
        return None

    def distribution(logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.softmax(logprobs * (1.0 / temperature), axis=-1)

    return distribution


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs`` (nonnegative, not necessarily summing to 1)."""
    cumulative = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(probs) - 1)


def accept_sampled(probs: np.ndarray, draft: Sequence[int], rng: np.random.Generator) -> tuple[int, int]:
    """Verify ``draft`` against ``probs`` ``(len(draft) + 1, vocab)``, row ``i`` the
    distribution of the token at draft position ``i`` (the last row: of the token after a
    wholly accepted draft). Returns (how many draft tokens are accepted, the next token:
    drawn from the residual at the first rejection, else from the last row)."""
    for i, token in enumerate(draft):
        if rng.random() >= probs[i, token]:  # rejected: draw from p without the draft token
            residual = np.array(probs[i], dtype=np.float64)
            residual[token] = 0.0
            if residual.any():  # (else ``p`` is all on the token, short of 1 by rounding: kept)
                return i, _draw(residual, rng)
    return len(draft), _draw(probs[len(draft)], rng)
