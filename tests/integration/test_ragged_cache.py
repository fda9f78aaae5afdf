"""Rows of one batch cache cut back by different counts hold what each row's own cache holds.

Three sequences of different lengths decode together on a tiny random llama, and on
Gemma 3 and GPT-OSS shapes whose sliding window (48 tokens) the rows outgrow; after a step
of several tokens each row drops its own number of them (``trim_rows``), as speculating
rows do after their drafts are verified. Then: the next step's logits of every row equal
those of the row's tokens prefilled alone (the holes are masked, the positions count only
kept tokens), and ``extract`` gives back exactly the kept tokens' keys and values. Fails if
a hole is attended to, if a row's position counts its holes (or its sliding window
does), or if extract keeps one.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from app.engine.ragged_cache import RaggedBatchKVCache, compacted
from support.families import ATTENTION, build

SHORT = [[5, 9, 13, 200, 41, 77, 3], [8, 1, 99], [17, 23, 29, 31, 37]]
# Longer than the windowed families' sliding window (48), by different amounts.
LONG = [list(range(1000, 1000 + n)) for n in (55, 47, 61)]


@pytest.fixture(scope="module", params=["llama", "gemma3", "gpt_oss"])
def case(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """(a tiny model of the family, its rows' prompts)."""
    return build(ATTENTION[request.param]), SHORT if request.param == "llama" else LONG


def alone(model, tokens: list[int]) -> tuple[list[KVCache], mx.array]:  # type: ignore[no-untyped-def]
    """A row's cache and last logits, prefilled on its own."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    return cache, logits


def test_rows_cut_back_by_different_counts_attend_to_their_kept_tokens_only(case) -> None:  # type: ignore[no-untyped-def]
    model, prompts = case
    caches = [alone(model, p[:-1])[0] for p in prompts]
    batch = [compacted([c[layer] for c in caches]) for layer in range(len(model.layers))]
    assert all(isinstance(layer, RaggedBatchKVCache) for layer in batch)
    steps = [[p[-1], 300, 301, 302] for p in prompts]  # each row's last prompt token and a 3-token "draft"
    drops = [[3, 0, 2], [1, 2, 0]]  # two steps: each row keeps its own part of each
    kept = [list(p) for p in prompts]
    for step, drop in enumerate(drops):
        fed = [s if step == 0 else [k[-1] + 1, 400 + step, 401, 402] for s, k in zip(steps, kept)]
        model(mx.array(fed), cache=batch)
        for layer in batch:
            layer.trim_rows(drop)
        for row, (tokens, n_drop) in enumerate(zip(fed, drop)):
            new = tokens[:len(tokens) - n_drop]
            kept[row] = (kept[row][:-1] if step == 0 else kept[row]) + new
    assert batch[0].n_holes > 0
    # The next token of every row: the batch's logits against each row's own prefill.
    nxt = [[7], [11], [19]]
    logits = model(mx.array(nxt), cache=batch)[:, -1]
    for row, tokens in enumerate(kept):
        own_cache, own = alone(model, tokens + nxt[row])
        np.testing.assert_allclose(np.array(logits[row]), np.array(own), atol=2e-4, rtol=2e-4)
        extracted = batch[0].extract(row)
        assert extracted.offset == len(tokens) + 1
        np.testing.assert_allclose(np.array(extracted.keys), np.array(own_cache[0].keys[..., :own_cache[0].offset, :]),
                                   atol=2e-4, rtol=2e-4)


def test_filtering_and_extending_keep_each_rows_holes(case) -> None:  # type: ignore[no-untyped-def]
    model, prompts = case
    caches = [alone(model, p[:-1])[0] for p in prompts]
    batch = [compacted([c[layer] for c in caches]) for layer in range(len(model.layers))]
    model(mx.array([[p[-1], 300, 301] for p in prompts]), cache=batch)
    for layer in batch:
        layer.trim_rows([2, 0, 1])
    kept = [prompts[0], prompts[1] + [300, 301], prompts[2] + [300]]
    for layer in batch:
        layer.filter([0, 2])  # the middle row leaves
    joining = alone(model, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69])[0]
    for layer, own in zip(batch, joining):
        layer.extend(compacted([own]))
    kept = [kept[0], kept[2], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
    logits = model(mx.array([[7], [7], [7]]), cache=batch)[:, -1]
    for row, tokens in enumerate(kept):
        np.testing.assert_allclose(np.array(logits[row]), np.array(alone(model, tokens + [7])[1]),
                                   atol=2e-4, rtol=2e-4)
