"""mlxhost's in-process engine: models, workers and admission. Pure Python; never imports Django."""

from __future__ import annotations

from mlxhost.engine.config import EngineConfig
from mlxhost.engine.disk import remove_saved
from mlxhost.engine.engine import Engine, Permit, is_internal_name
from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    EngineClosedError,
    EngineError,
    GenerationFailedError,
    InvalidModelFolderError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
    RequestTooLargeError,
    UnknownModelError,
    WeightsChangedError,
)
from mlxhost.engine.generation import Generation
from mlxhost.engine.retention import Retention
from mlxhost.engine.sessions import SessionQuery, SessionScoper
from mlxhost.engine.stats import Histogram, RequestStats
from mlxhost.engine.types import (
    Delta,
    Done,
    Event,
    Failed,
    FinishReason,
    GenerationRequest,
    LaneSettings,
    Message,
    ModelSpec,
    Queued,
    Role,
    SamplingParams,
    Started,
    Timings,
    Usage,
)
from mlxhost.engine.weights import folder_fingerprint, hub_fingerprint, resolve_under, validate_model_folder

__all__ = [
    "Delta",
    "Done",
    "DrainingError",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "Event",
    "Failed",
    "FinishReason",
    "Generation",
    "GenerationFailedError",
    "GenerationRequest",
    "Histogram",
    "InvalidModelFolderError",
    "InvalidRequestError",
    "LaneSettings",
    "Message",
    "ModelLoadError",
    "ModelSpec",
    "Permit",
    "PromptTooLongError",
    "QueueFullError",
    "QueueTimeoutError",
    "Queued",
    "RequestCancelledError",
    "RequestStats",
    "RequestTooLargeError",
    "Retention",
    "Role",
    "SamplingParams",
    "SessionQuery",
    "SessionScoper",
    "Started",
    "Timings",
    "UnknownModelError",
    "Usage",
    "WeightsChangedError",
    "folder_fingerprint",
    "hub_fingerprint",
    "is_internal_name",
    "remove_saved",
    "resolve_under",
    "validate_model_folder",
]
