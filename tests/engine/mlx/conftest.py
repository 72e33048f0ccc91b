"""Fixtures for the engine tests with the real tiny MLX model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from mlxhost.engine import Engine, EngineConfig, LaneSettings, ModelSpec

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
async def engines(tiny_model_dir: Path):
    """`make(capacity)`: a loaded mlx engine serving the tiny model; every engine shuts down after."""
    made: list[Engine] = []

    async def make(capacity: int) -> tuple[Engine, ModelSpec]:
        engine = Engine(EngineConfig(backend="mlx"))
        made.append(engine)
        spec = ModelSpec(
            instance_id=1,
            source=str(tiny_model_dir),
            fingerprint="f" * 64,
            lane=LaneSettings(capacity=capacity),
        )
        await engine.load(spec)
        return engine, spec

    yield make
    for engine in made:
        await engine.shutdown()
