"""The defaults a backend implies (app/engine/backend.py), chosen by what the device is,
tested without the hardware: a CPU, an NVIDIA GPU and an Apple GPU as values."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.catalog.registry import Catalog
from app.engine.backend import (
    MIN_CACHE_BUDGET, Backend, cache_budget, drafts_pay, prefill_step, warmup_chunks)
from app.main import _machine_defaults
from app.settings import load_settings

GIB = 1 << 30
CPU = Backend("cpu", 24 * GIB, "Intel(R) Xeon(R)")
H200 = Backend("cuda", 141 * GIB, "NVIDIA H200")
M4 = Backend("metal", 64 * GIB, "applegpu_g16s")


def test_the_prefill_step_is_chosen_per_backend() -> None:
    assert prefill_step(CPU) == 256  # measured best on the 2-core CPU
    assert prefill_step(H200) == prefill_step(M4) == 2048  # 2.4x faster than 256 on an H200


def test_the_cache_budget_is_a_share_of_the_memory_beside_the_weights() -> None:
    weights_8b = 5 * GIB
    assert cache_budget(H200, weights_8b) == (136 * GIB) // 2
    assert cache_budget(M4, 40 * GIB) == 12 * GIB
    assert cache_budget(CPU, 100 << 20) == ((24 * GIB - (100 << 20)) // 4) >> 20 << 20
    # A 13.8K-token conversation of an 8B shape needs a 1.8 GB working copy: the old fixed
    # 2 GiB spilled it while loading it; the H200's budget holds dozens.
    assert cache_budget(H200, weights_8b) > 30 * 1.8e9
    assert cache_budget(Backend("cuda", 8 * GIB, "small"), 9 * GIB) == MIN_CACHE_BUDGET
    assert cache_budget(CPU, 0) % (1 << 20) == 0


def test_only_an_nvidia_gpu_warms_up_before_serving() -> None:
    """mlx-cuda compiles kernels per kind of shape on first use (a first 8K-token prefill of
    61 s on a fresh H200): a long chunk, a short one and a decode step run before the first
    request there. The CPU and Metal run none beyond the head-dims probe."""
    assert warmup_chunks(H200, prefill_step(H200)) == (2048, 32, 1)
    assert warmup_chunks(H200, 512) == (512, 32, 1)  # a prefill_step_size that was set
    assert warmup_chunks(CPU, prefill_step(CPU)) == warmup_chunks(M4, prefill_step(M4)) == ()


def test_drafts_are_on_where_they_pay() -> None:
    """On an H200 a draft's check built a cuDNN graph per step: 26.7 tok/s with drafts, 95.5
    without (docs/benchmarks.md, "On a GPU"); on the CPU drafts pay."""
    assert drafts_pay(CPU) and drafts_pay(M4)
    assert not drafts_pay(H200)


@pytest.mark.parametrize(("backend", "env", "drafts"), [
    (H200, {}, 0),
    (CPU, {}, 8),
    (H200, {"SEMANTIC_SPECULATIVE_TOKENS": "4"}, 4),  # set: kept on any backend
    (H200, {"SEMANTIC_SPECULATIVE_TOKENS": "8"}, 8),  # set to the default is set too
    (CPU, {"SEMANTIC_SPECULATIVE_TOKENS": "0"}, 0),
    (H200, {"SEMANTIC_DRAFT_MODEL": "small-drafter"}, 8),  # a draft model set drafts
])
def test_the_server_takes_the_draft_length_set_or_its_backends(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        backend: Backend, env: dict[str, str], drafts: int) -> None:
    monkeypatch.setattr("app.engine.backend.detect", lambda: backend)
    # The budget set: a derived one imports the embedded model first (tests/integration/test_machine_defaults.py).
    settings = load_settings({"SEMANTIC_HOME": str(tmp_path), "SEMANTIC_CACHE_MEMORY_BYTES": str(GIB), **env})
    catalog = Catalog.configure(settings.models_dir, settings.model, {}, True, False)
    with caplog.at_level(logging.INFO, logger="app.main"):
        step, budget, chosen = _machine_defaults(settings, catalog)
    assert (step, budget, chosen) == (prefill_step(backend), GIB, drafts)
    assert not settings.models_dir.exists() or not any(settings.models_dir.iterdir())  # nothing imported: it was set
    said = "set" if "SEMANTIC_SPECULATIVE_TOKENS" in env else "for the draft model" if env else "per backend"
    assert caplog.records[-1].getMessage().endswith(
        f"{f'drafts of up to {drafts} tokens' if drafts else 'no drafts'} ({said})")
