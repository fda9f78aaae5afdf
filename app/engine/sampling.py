"""A sequence's sampler, and the log-probabilities of what it drew (MLX).

Unseeded sampling is mlx-lm's ``make_sampler``: it draws from MLX's one global generator,
shared by every sequence, so what a sequence draws depends on what else ran. A seeded
sequence (a request's ``seed``) has its own generator instead: a key made from the seed,
split once per token drawn, so the same prompt, settings and seed draw the same tokens
(up to float rounding between batch shapes: on an idle server, the same reply). It filters
as ``make_sampler`` does (top-p, then top-k, then the temperature).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_sampler

from app.engine.token_text import TokenBytes
from app.types import TokenLogprob

Sampler = Callable[[mx.array], mx.array]


def sampler_for(temperature: float, top_p: float, top_k: int, seed: int | None) -> Sampler:
    """The sampler of a sequence (greedy at temperature 0, whatever the seed)."""
    if seed is None or temperature == 0:
        return make_sampler(temp=temperature, top_p=top_p, top_k=top_k)
    key = mx.random.key(seed % (1 << 64))

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        key, draw = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / temperature), key=draw)

    return sampler


def _entry(token_bytes: TokenBytes, token: int, logprob: float) -> TokenLogprob:
    try:
        raw = token_bytes[token]
    except IndexError:  # a padding row of the logits, past the tokenizer's vocabulary
        raw = b""
    return TokenLogprob(raw.decode("utf-8", errors="replace"), tuple(raw), logprob)


def token_logprobs(logprobs: mx.array, token: int, n_top: int, token_bytes: TokenBytes) -> TokenLogprob:
    """``token``'s entry from the normalized log-probabilities ``(vocab,)`` it was drawn
    from, with the ``n_top`` most likely tokens (tokens a grammar ruled out are never listed)."""
    logprobs = logprobs.astype(mx.float32)
    top: tuple[TokenLogprob, ...] = ()
    if n_top > 0:
        n = min(n_top, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
        values = logprobs[ids]
        mx.eval(ids, values)
        id_list: list[int] = ids.tolist()  # type: ignore[assignment]  # a vector of ints
        value_list: list[float] = values.tolist()  # type: ignore[assignment]  # a vector of floats
        ranked = sorted(zip(id_list, value_list), key=lambda pair: -pair[1])
        top = tuple(_entry(token_bytes, i, v) for i, v in ranked if v != float("-inf"))
    chosen = _entry(token_bytes, token, float(logprobs[token].item()))  # type: ignore[arg-type]
    return TokenLogprob(chosen.token, chosen.bytes, chosen.logprob, top)
