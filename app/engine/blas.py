"""Load a fast BLAS before MLX on Linux CPU, and report which BLAS is in use.

The ``mlx[cpu]`` wheel bundles netlib's reference BLAS, far slower for float32 matmul
(docs/benchmarks.md, "Measured choices in the code"). Loading OpenBLAS with
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
        if blas_in_use().startswith("openblas"):
            return None  # already loaded first, by an earlier call
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


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def blas_in_use() -> str:
    """Which library MLX's ``cblas_sgemm`` calls resolve to.

    MLX binds BLAS symbols through the global scope, so the library that
    provides ``cblas_sgemm`` there is the one in use. If none does, MLX uses the
    reference BLAS bundled with its wheel (loaded privately). Other OpenBLAS
    copies (numpy's ``scipy_openblas``) use renamed symbols and do not count.
    """
    if platform.system() == "Darwin":
        return "accelerate"
    process = ctypes.CDLL(None)
    try:
        symbol = process.cblas_sgemm
    except AttributeError:
        return "reference (bundled with mlx)" if "mlx.core" in sys.modules else "none"
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return "unknown"
    name = Path(info.dli_fname.decode()).name
    return f"openblas ({name})" if "openblas" in name else name
