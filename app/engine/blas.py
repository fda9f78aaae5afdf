"""Load a fast BLAS before MLX on Linux CPU, and report which BLAS is in use.

The ``mlx[cpu]`` wheel bundles netlib's reference BLAS (about 70x slower for
float32 matmul on the development machine). Loading OpenBLAS with
``RTLD_GLOBAL`` before ``mlx.core`` is imported makes MLX bind to it. Must run
before anything imports MLX; imports nothing heavy itself.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas(explicit: str = "") -> Path | None:
    """The OpenBLAS library to load: ``explicit`` if given, else the first found."""
    if explicit:
        return Path(explicit) if Path(explicit).exists() else None
    for candidate in (*OPENBLAS_CANDIDATES, *sorted(glob.glob("/usr/lib/*/libopenblas*.so*"))):
        if Path(candidate).exists():
            return Path(candidate)
    return None


def load_fast_blas(explicit: str = "") -> Path | None:
    """Load OpenBLAS globally on Linux before MLX is imported; warn loudly if absent.

    ``explicit`` is a library path, "" to search the usual places, or "none" to
    keep MLX's bundled reference BLAS (for benchmarks).

    Returns:
        The library loaded, or None (not Linux, or not found).
    """
    if platform.system() != "Linux" or explicit == "none":
        return None
    if "mlx.core" in sys.modules:
        log.warning("MLX was imported before the BLAS library could be chosen")
    path = find_openblas(explicit)
    if path is None:
        log.warning(
            "!!! OpenBLAS not found: MLX will use its bundled reference BLAS, about "
            "70x slower. Install it: apt-get install libopenblas0-pthread !!!"
        )
        return None
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


def blas_in_use() -> str:
    """The BLAS library mapped into this process, as the OS sees it."""
    if platform.system() == "Darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    libraries = {Path(line.split()[-1]).name for line in maps.splitlines() if "blas" in line.lower()}
    for name in sorted(libraries):
        if "openblas" in name:
            return f"openblas ({name})"
    return "reference (bundled with mlx)" if libraries or "mlx.core" in sys.modules else "none"
