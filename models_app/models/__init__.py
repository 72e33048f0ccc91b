"""The app's Django models, in two modules: `core` (models, aliases, instances, keys, usage,
stored responses, tombstones) and `derived` (a Model's quantized copies and LoRA adapters).
Import them from here."""

from models_app.models.core import (
    ApiKey,
    BaseModel,
    InstanceTombstone,
    Model,
    ModelAlias,
    ModelInstance,
    StoredResponse,
    UsageDay,
    validate_template_kwargs,
)
from models_app.models.derived import Adapter, QuantizedCopy

__all__ = [
    "Adapter",
    "ApiKey",
    "BaseModel",
    "InstanceTombstone",
    "Model",
    "ModelAlias",
    "ModelInstance",
    "QuantizedCopy",
    "StoredResponse",
    "UsageDay",
    "validate_template_kwargs",  # named by migration 0004
]
