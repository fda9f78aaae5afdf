"""The defaults a start derives from the machine and the default model (app/main.py), on a
home that has imported nothing yet: the embedded model's weights are counted, as on every
later start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.catalog.registry import Catalog
from app.engine.backend import cache_budget, detect, weights_bytes
from app.main import _machine_defaults
from app.settings import load_settings


def test_a_fresh_homes_first_start_counts_the_embedded_models_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # SmolLM2: any embedded model proves it, and the default (the 1.5B) imports 6.6 GB in 40 s.
    settings = load_settings({"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_MODEL": "smollm2-135m-instruct"})
    catalog = Catalog.configure(settings.models_dir, settings.model, {}, True, False)
    assert weights_bytes(catalog.path(catalog.default)) == 0  # not imported yet
    with caplog.at_level(logging.INFO, logger="app.main"):
        _, budget, _ = _machine_defaults(settings, catalog)
    weights = weights_bytes(catalog.path(catalog.default))
    assert weights > 100 << 20  # imported before the budget was derived
    assert budget == cache_budget(detect(), weights) < cache_budget(detect(), 0)
    assert f"from the machine, beside {weights / 2**30:.1f} GiB of weights" in caplog.records[-1].getMessage()
