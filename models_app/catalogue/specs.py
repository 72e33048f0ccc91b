"""A catalogue row in the engine's terms: a model's `ModelSpec`, an alias's sampling defaults merged
with a request's, and its chat-template options (REG-3, OPS-3, API-9). Pure mapping: no query."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings

from mlxhost.engine import (
    ALIAS_SAMPLING_FIELDS,
    SAMPLING_KNOBS,
    KVQuantization,
    LaneSettings,
    ModelSpec,
    SamplingParams,
    resolve_under,
)
from models_app.models import Model, ModelInstance

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mlxhost.engine import ModelKind
    from models_app.models import ModelAlias

# Shaped apart in `sampling_params_for`: clamped by the alias, or turned into tuples.
_SHAPED_FIELDS = ("max_tokens", "stop", "logit_bias")
# The alias defaults the request's values override, and the knobs only a request sets.
SAMPLING_FIELDS = tuple(name for name in ALIAS_SAMPLING_FIELDS if name not in _SHAPED_FIELDS)
REQUEST_ONLY_FIELDS = tuple(
    name for name in SAMPLING_KNOBS if name not in ALIAS_SAMPLING_FIELDS and name not in _SHAPED_FIELDS
)


def model_spec_for(
    *, model: Model | None = None, alias: ModelAlias | None = None, instance: ModelInstance | None = None
) -> ModelSpec:
    """What the engine needs to host `model` (or `alias`'s model) on its instance, or on `instance`,
    weights being reloaded for it. Lane and memory settings come from the model only, so every
    alias of it gives the same spec; the engine never sees an alias's settings."""
    if model is None:
        assert alias is not None, "pass a model or an alias"
        model = alias.model
    instance = instance or model.instance
    assert instance is not None, "a model is saved with its instance"
    if instance.source_kind == ModelInstance.SourceKind.HUB:
        source, revision = instance.source, instance.revision or None
    else:
        source, revision = str(resolve_under(Path(settings.MODELS_ROOT), instance.source)), None
    return ModelSpec(
        instance_id=instance.pk,
        source=source,
        revision=revision,
        fingerprint=instance.fingerprint,
        # A local folder is re-hashed at every load, so edited files never keep the old id (REG-3).
        verify_weights=instance.source_kind == ModelInstance.SourceKind.LOCAL,
        lane=LaneSettings(
            capacity=model.concurrency,
            queue_depth=model.queue_depth,
            unbounded=model.queue_unbounded,
            queue_timeout_s=model.queue_timeout_s,
        ),
        keep_alive_s=model.keep_alive_s,  # None: never freed for idleness (OPS-3)
        pinned=model.pinned,
        kind=model_kind(model),
        kv_quantization=KVQuantization.from_tag(instance.kv_format),
        # Its draft model (speculative decoding); the instance's fingerprint includes the draft's.
        draft=model_spec_for(model=model.draft_model) if model.draft_model is not None else None,
    )


def model_kind(model: Model) -> ModelKind:
    """The engine's kind of `model` (its column's values are the engine's names)."""
    kinds: dict[str, ModelKind] = {"chat": "chat", "embedding": "embedding", "vision": "vision"}
    return kinds[model.kind]


def sampling_params_for(*, alias: ModelAlias, overrides: Mapping[str, Any]) -> SamplingParams:
    """Merge request > alias default > engine default, and clamp output length by the alias."""
    values: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = overrides.get(name)
        values[name] = value if value is not None else getattr(alias, name)
    for name in REQUEST_ONLY_FIELDS:
        if overrides.get(name) is not None:
            values[name] = overrides[name]
    wanted = overrides.get("max_tokens") or alias.max_tokens
    values["max_tokens"] = max(1, min(int(wanted), alias.max_output_tokens))
    values["stop"] = tuple(overrides.get("stop") or ())
    values["logit_bias"] = tuple(
        sorted((int(k), float(v)) for k, v in (overrides.get("logit_bias") or {}).items())
    )
    return SamplingParams(**values)


# Reasoning effort as Anthropic (`output_config.effort`) and OpenAI (`reasoning.effort`,
# `reasoning_effort`) name it, and what reaches the chat template's `reasoning_effort` (the
# low/medium/high that templates with that keyword know). None: thinking off.
EFFORTS: dict[str, str | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def template_options_for(
    alias: ModelAlias, *, thinking: bool | None = None, effort: str | None = None
) -> tuple[tuple[str, object], ...]:
    """The alias's chat-template keywords (API-9); a request's own `thinking` choice wins over the
    alias's, and neither set leaves the model's default.

    A request's reasoning `effort` (a key of EFFORTS) goes to the template as `reasoning_effort`
    and, where the request left `thinking` open, sets the thinking switch: on for any effort but
    "none" and "minimal". A template without these keywords ignores them.
    """
    options = dict(alias.chat_template_kwargs or {})
    if effort is not None:
        level = EFFORTS[effort]
        if level is not None:
            options["reasoning_effort"] = level
        if thinking is None:
            thinking = effort not in ("none", "minimal")
    choice = thinking if thinking is not None else alias.enable_thinking
    if choice is not None:
        options["enable_thinking"] = choice
    return tuple(sorted(options.items()))
