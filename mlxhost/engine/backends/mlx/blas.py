"""OpenBLAS preloading for MLX's CPU backend on Linux."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# Debian's libopenblas0-pthread, then other common places.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def preload_openblas() -> str:
    """Load a system OpenBLAS with RTLD_GLOBAL so libmlx binds its cblas symbols to it.

    Must run before the first `import mlx.core`; loaded later it has no effect.
    Returns a short status: "openblas:<path>", "not-linux", "already-imported" or "missing".
    """
    if not sys.platform.startswith("linux"):
        return "not-linux"
    if "mlx.core" in sys.modules:
        return "already-imported"
    override = os.environ.get("MLXHOST_OPENBLAS")
    candidates = (override,) if override else OPENBLAS_CANDIDATES
    for path in candidates:
        if path and Path(path).exists():
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return f"openblas:{path}"
    logger.warning(
        "OpenBLAS not found; MLX on CPU uses reference BLAS and runs ~30x slower. "
        "Install Debian's libopenblas0-pthread (make run does this when it can)."
    )
    return "missing"
