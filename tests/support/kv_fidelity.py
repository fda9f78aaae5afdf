"""Fidelity measurements of the tests and of benchmarks/kv_fidelity.py beyond the
teacher-forced scores of ``app.engine.fidelity``: greedy agreement and a needle."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from app.cache.formats import KV_FORMATS
from app.engine.fidelity import copy_cache, natural_texts, prefill, roundtrip


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
    return {name: sum(a == b for a, b in zip(reference, greedy(model, roundtrip(base, n, KV_FORMATS[name]),
                                                                tokens[-1], n_tokens)))
            for name in formats}


def needle_prompt(tokenizer: Any, n_filler_tokens: int, secret: str) -> list[int]:
    """A fact at the start of a long context, asked for at the end, in the chat template."""
    filler_ids = tokenizer.encode(natural_texts()["prose"])[:n_filler_tokens]
    filler = tokenizer.decode(filler_ids)
    messages = [{"role": "user", "content": f"Remember this: the secret passphrase is {secret}.\n\n{filler}\n\n"
                 "What is the secret passphrase? Answer with the passphrase only."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
