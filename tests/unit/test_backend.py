"""The defaults a backend implies (app/engine/backend.py), chosen by what the device is,
tested without the hardware: a CPU, an NVIDIA GPU and an Apple GPU as values."""

from __future__ import annotations

from app.engine.backend import MIN_CACHE_BUDGET, Backend, cache_budget, prefill_step, warmup_chunks

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
