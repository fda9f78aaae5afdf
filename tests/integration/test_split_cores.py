"""A batch of agents of different context lengths decodes the same greedy tokens on both real
models whether its steps are split over both CPU cores (app/engine/cores.py) or run plain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from app.engine.batch import DecodeBatch, prefill
from app.engine.blas import blas_in_use
from app.engine.model import LoadedModel, load_model

LENGTHS = (30, 200, 700)  # tokens of each row's context: left padding in the batch
STEPS = 12


def decode(loaded: LoadedModel, split: bool) -> list[list[tuple[int, int]]]:
    assert loaded.cores is not None
    batch = DecodeBatch(loaded.model)
    for uid, n in enumerate(LENGTHS):
        tokens = [(7 * i + uid) % 5000 + 10 for i in range(n)]
        cache = make_prompt_cache(loaded.model)
        prefill(loaded.model, cache, tokens[:-1])
        batch.add(uid, cache, tokens[-1], tokens[:-1], greedy_sampler, [])
    loaded.cores.use(split)
    try:
        return [batch.step() for _ in range(STEPS)]
    finally:
        loaded.cores.use(False)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_split_steps_decode_what_plain_steps_do(which: str, request: pytest.FixtureRequest) -> None:
    if not blas_in_use().startswith("openblas") or (os.cpu_count() or 1) < 2:
        pytest.skip("the split applies to OpenBLAS on two cores or more")
    model_dir: Path = request.getfixturevalue(f"{which}_dir")
    loaded = load_model(which, model_dir, split_cores=True)
    assert loaded.cores is not None
    assert decode(loaded, split=True) == decode(loaded, split=False)
