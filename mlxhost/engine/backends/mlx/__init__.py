"""The MLX backend package: the only code in mlxhost that imports `mlx` / `mlx_lm`.

Importing this package first preloads a system OpenBLAS (see `blas.py`), because
the `mlx-cpu` wheel resolves `cblas_sgemm` when `libmlx.so` loads and its bundled
reference BLAS is 30x slower. Every module here imports mlx only after that.
"""

from __future__ import annotations

from mlxhost.engine.backends.mlx.blas import preload_openblas

BLAS_STATUS = preload_openblas()
