"""Backend selection: `make_backend("mlx" | "fake" | "fake:SCRIPT.json")`; mlx is imported only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import Backend


def make_backend(name: str) -> Backend:
    """Build the named backend.

    Raises:
        ValueError: the name is not a known backend.
    """
    if name == "fake" or name.startswith("fake:"):
        from pathlib import Path

        from mlxhost.engine.backends.fake import FakeBackend

        script = name.partition(":")[2]
        return FakeBackend.from_script(Path(script)) if script else FakeBackend()
    if name == "mlx":
        from mlxhost.engine.backends.mlx.serving import ServingBackend

        return ServingBackend()
    raise ValueError(f"Unknown engine backend {name!r}; expected 'mlx', 'fake' or 'fake:SCRIPT.json'.")
