"""mlxhost's in-process engine: models, workers and admission. Pure Python; never imports Django."""

from __future__ import annotations

from mlxhost.engine.config import EngineConfig
from mlxhost.engine.engine import Engine
from mlxhost.engine.errors import (
    EngineClosedError,
    EngineError,
    GenerationFailedError,
    InvalidModelFolderError,
    ModelLoadError,
    PromptTooLongError,
    UnknownModelError,
)
from mlxhost.engine.generation import Generation
from mlxhost.engine.types import (
    Delta,
    Done,
    Event,
    Failed,
    GenerationRequest,
    Message,
    ModelSpec,
    SamplingParams,
    Started,
    Timings,
    Usage,
)

__all__ = [
    "Delta",
    "Done",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "Event",
    "Failed",
    "Generation",
    "GenerationFailedError",
    "GenerationRequest",
    "InvalidModelFolderError",
    "Message",
    "ModelLoadError",
    "ModelSpec",
    "PromptTooLongError",
    "SamplingParams",
    "Started",
    "Timings",
    "Usage",
    "UnknownModelError",
]
