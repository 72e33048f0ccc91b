"""Backend selection: `make_backend("mlx" | "fake")`; mlx is imported only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import Backend


def make_backend(name: str) -> Backend:
    """Build the named backend.

    Raises:
        ValueError: the name is not a known backend.
    """
    if name == "fake":
        from mlxhost.engine.backends.fake import FakeBackend

        return FakeBackend()
    if name == "mlx":
        from mlxhost.engine.backends.mlx.backend import MlxBackend

        return MlxBackend()
    raise ValueError(f"Unknown engine backend {name!r}; expected 'mlx' or 'fake'.")
