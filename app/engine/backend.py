"""The machine the engine computes on, and the defaults it implies.

``Backend`` says what MLX computes on (the CPU, an NVIDIA GPU through mlx-cuda, an Apple
GPU through Metal) and how much memory it computes in (RAM; the GPU's memory; the unified
memory). The defaults that depend on it are pure functions of that value, so each choice is
tested without the hardware: ``prefill_step`` (the largest prefill chunk: small on a CPU, whose
attention work grows with the chunk, large on a GPU, which a small chunk leaves idle;
docs/benchmarks.md has the measurements) and ``cache_budget`` (the bytes
of KV cache kept in memory: a share of what the weights leave) and ``drafts_pay`` (drafts
on where they pay). ``detect`` is the only
function that asks MLX. (Where a restored cache's working copy is built is the cache's own
choice, by the device: ``app.cache.blocks.working_streams``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["cpu", "cuda", "metal"]

# The largest prefill chunk per backend, in tokens (setting prefill_step_size = 0).
PREFILL_STEP: dict[Kind, int] = {"cpu": 256, "cuda": 2048, "metal": 2048}
# The share of the memory left beside the weights that KV caches may hold (setting
# cache_memory_bytes = 0). A CPU shares its RAM with everything else on the machine; a GPU's
# memory holds the weights, the activations of a prefill chunk and the caches.
CACHE_SHARE: dict[Kind, float] = {"cpu": 0.25, "cuda": 0.5, "metal": 0.5}
MIN_CACHE_BUDGET = 1 << 30  # the budget never goes below 1 GiB, however full the memory
# The short prefill chunk of a warm-up (a turn's few new tokens on a cached context).
WARMUP_SHORT_TOKENS = 32
# Whether prompt-lookup drafts pay on a backend (setting speculative_tokens not set). On an NVIDIA
# GPU a draft's check is a forward pass of a few tokens at a new cache length each step, and
# mlx-cuda's attention for more than one query builds a cuDNN graph per shape (likely; not
# profiled): on an H200 greedy decode with drafts was far slower than without (docs/benchmarks.md,
# "On a GPU"). On the CPU they pay (docs/benchmarks.md, "Speculative decoding").
DRAFTS_PAY: dict[Kind, bool] = {"cpu": True, "cuda": False, "metal": True}


@dataclass(frozen=True, slots=True)
class Backend:
    kind: Kind
    memory_bytes: int  # what the model and its caches compute in
    name: str  # the device's name, for logs and benchmark results

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"


def prefill_step(backend: Backend) -> int:
    """The largest prefill chunk on ``backend``, in tokens."""
    return PREFILL_STEP[backend.kind]


def drafts_pay(backend: Backend) -> bool:
    """Whether requests on ``backend`` draft by prompt lookup unless told."""
    return DRAFTS_PAY[backend.kind]


def warmup_chunks(backend: Backend, step: int) -> tuple[int, ...]:
    """The forward passes a model loaded on ``backend`` runs before it serves, in tokens, one
    after another on one cache: on an NVIDIA GPU a full prefill chunk of ``step`` tokens, a short
    chunk after it and a decode step, so that the first requests do not compile their kernels.
    mlx-cuda compiles a kernel on its first use per kind of shape (a long prefill, a few tokens,
    one token) and keeps it in a disk cache, so on a fresh GPU the first pass of each kind is
    many times the next one (docs/benchmarks.md, "On a GPU"). On the CPU and on Metal, nothing: the head-dims probe's
    pass is the warm-up (``model.cached_head_dims``) and neither compiles per shape."""
    if backend.kind != "cuda":
        return ()
    return (step, WARMUP_SHORT_TOKENS, 1)


def cache_budget(backend: Backend, weights_bytes: int) -> int:
    """Bytes of KV cache to keep in memory on ``backend`` beside ``weights_bytes`` of weights
    (whole MiB)."""
    left = max(0, backend.memory_bytes - weights_bytes)
    return max(MIN_CACHE_BUDGET, int(left * CACHE_SHARE[backend.kind])) >> 20 << 20


def detect() -> Backend:
    """The backend MLX computes on in this process (its default device)."""
    import mlx.core as mx

    kind = device_kind()
    if kind != "cpu":
        info = mx.device_info()
        memory = int(info.get("total_memory") or info.get("memory_size") or 0) or _ram_bytes()
        return Backend(kind, memory, str(info.get("device_name") or info.get("architecture") or kind))
    info = mx.device_info()
    return Backend("cpu", _ram_bytes(), str(info.get("device_name") or "cpu"))


def device_kind() -> Kind:
    """What MLX's default device is: the CPU, an NVIDIA GPU (mlx-cuda) or an Apple GPU (Metal)."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        return "metal" if mx.metal.is_available() else "cuda"
    return "cpu"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return 8 << 30


def weights_bytes(model_dir: Path) -> int:
    """Bytes of a model directory's weight files (0 if it is not there; links followed: a
    Hugging Face view's point into the cache, and one whose target is gone counts 0)."""
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors") if path.exists())
