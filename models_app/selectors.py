"""Reads: resolve aliases, authenticate API keys, merge sampling settings, build specs, stored rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from mlxhost.engine import LaneSettings, ModelSpec, SamplingParams
from mlxhost.engine.weights import resolve_under
from models_app.apikeys import key_matches, key_prefix
from models_app.models import ApiKey, ModelAlias, ModelInstance, StoredResponse

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
REQUEST_ONLY_FIELDS = ("presence_penalty", "frequency_penalty", "seed")


def alias_resolve(*, name: str) -> ModelAlias:
    """The enabled alias called `name`, with its instance. Never treats `name` as a path.

    Raises:
        ModelAlias.DoesNotExist: no enabled alias has that name, or it has no instance yet.
    """
    return ModelAlias.objects.select_related("instance").get(name=name, enabled=True, instance__isnull=False)


def aliases_enabled() -> QuerySet[ModelAlias]:
    return ModelAlias.objects.select_related("instance").filter(enabled=True, instance__isnull=False)


def alias_local_folder(*, alias: ModelAlias) -> Path:
    """The absolute folder of a local alias, which must lie under MODELS_ROOT."""
    return resolve_under(Path(settings.MODELS_ROOT), alias.local_path)


def model_spec_for(*, alias: ModelAlias, instance: ModelInstance | None = None) -> ModelSpec:
    """What the engine needs to host the alias's instance (or `instance`, weights being reloaded
    for it) with the alias's settings; the engine never sees the alias."""
    instance = instance or alias.instance
    assert instance is not None, "an alias is saved with its instance"
    if instance.source_kind == ModelInstance.SourceKind.HUB:
        source, revision = instance.source, instance.revision or None
    else:
        source, revision = str(resolve_under(Path(settings.MODELS_ROOT), instance.source)), None
    return ModelSpec(
        instance_id=instance.pk,
        source=source,
        revision=revision,
        fingerprint=instance.fingerprint,
        max_input_tokens=alias.max_input_tokens,
        lane=LaneSettings(
            capacity=alias.concurrency,
            queue_depth=alias.queue_depth,
            unbounded=alias.queue_unbounded,
            queue_timeout_s=alias.queue_timeout_s,
        ),
    )


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


def apikey_authenticate(*, raw_key: str) -> ApiKey | None:
    """The live key matching `raw_key` (owner active, not revoked), or None."""
    if not raw_key:
        return None
    key = (
        ApiKey.objects.select_related("owner")
        .filter(prefix=key_prefix(raw_key), revoked_at__isnull=True, owner__is_active=True)
        .first()
    )
    if key is None or not key_matches(raw_key, key.secret_hash):
        return None
    return key


def response_get(*, public_id: str, owner_id: int) -> StoredResponse:
    """The caller's unexpired stored response; another tenant's id is exactly a missing one (PER-6).

    Raises:
        StoredResponse.DoesNotExist: no such row for this owner (or it expired).
    """
    return StoredResponse.objects.select_related("alias").get(
        public_id=public_id, owner_id=owner_id, expires_at__gt=timezone.now()
    )


def responses_landed(*, public_ids: Iterable[str]) -> set[str]:
    """Which of `public_ids` have a row (any owner): the persist monitor's one query per tick."""
    ids = list(public_ids)
    return set(StoredResponse.objects.filter(public_id__in=ids).values_list("public_id", flat=True))
