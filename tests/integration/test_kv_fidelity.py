"""Stored KV formats against float KV on both real models (issue 11): a 1,024-token prose
prefix passed through each format by the product's own quantizer, the next 128 tokens
scored teacher-forced against the float cache's scores (tests/support/kv_fidelity.py;
the full measurement is benchmarks/kv_fidelity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.model import load_model
from support.kv_fidelity import natural_texts, teacher_forced

PREFIX, SCORED = 1024, 128
# Lower bounds on top-1 agreement with float KV, below what was measured at this size
# (see the README's KV format table): q4 is the one that visibly moves Gemma 3, and the
# default q4c (keys per channel) is what keeps Gemma 3 close at 4 bits.
BOUNDS = {"smollm2": {"q4": 0.88, "q4r": 0.90, "q4c": 0.88, "k8v4": 0.93, "q8": 0.98, "f16": 0.995},
          "gemma3": {"q4": 0.80, "q4r": 0.85, "q4c": 0.95, "k8v4": 0.93, "q8": 0.98, "f16": 0.995}}


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_stored_formats_keep_the_model_close_to_float_kv(which: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"{which}_dir")
    loaded = load_model(which, model_dir)
    tokens = loaded.tokenizer.encode(natural_texts()["prose"])[:PREFIX + SCORED + 1]
    scores = teacher_forced(loaded.model, tokens, PREFIX, list(BOUNDS[which]))
    print({name: (round(s.top1_agreement, 4), round(s.kl_mean, 5), round(s.perplexity_change, 4))
           for name, s in scores.items()})
    for name, bound in BOUNDS[which].items():
        assert scores[name].top1_agreement >= bound, (name, scores[name])
    # More bits for the keys, less divergence: the formats are ordered as documented.
    assert scores["f16"].kl_mean < scores["q8"].kl_mean < scores["k8v4"].kl_mean < scores["q4r"].kl_mean < scores["q4"].kl_mean
    assert scores["q4c"].kl_mean < scores["q4"].kl_mean
    if which == "gemma3":  # its keys have a few large channels: per-channel groups fit them, rotation less so
        assert scores["q4c"].kl_mean < scores["q4r"].kl_mean
    assert abs(scores["q8"].perplexity_change) < 0.01
