"""The engine's configuration dataclass, built once from `settings.MLXHOST_ENGINE`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend: str = "mlx"  # "mlx" or "fake"
    default_max_tokens: int = 512
    load_timeout_s: float = 600.0
    shutdown_timeout_s: float = 10.0
