"""Writes: register models and their weights, aliases, API keys, stored responses, tombstones."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from mlxhost.engine import (
    InvalidModelFolderError,
    detect_kind,
    folder_fingerprint,
    hub_fingerprint,
    remove_saved,
    resolve_under,
    validate_model_folder,
    with_draft,
)
from mlxhost.runtime import runtime_settings
from models_app.accounting.apikeys import key_generate, key_hash, key_prefix
from models_app.catalogue import adapters, control, hotcache, hub_pins
from models_app.catalogue.audit import ADDED, actor_named, audit_changes, audit_record, audit_saved
from models_app.catalogue.drafts import model_draft_check
from models_app.catalogue.kv_format import kv_format_check
from models_app.models import ApiKey, InstanceTombstone, Model, ModelAlias, ModelInstance, StoredResponse

if TYPE_CHECKING:
    from django.contrib.auth.models import User  # AUTH_USER_MODEL: ApiKey.owner's target

    from models_app.catalogue.audit import Actor

logger = logging.getLogger(__name__)
HF_REPO_HELP = "A Hugging Face repo id looks like 'owner/name'."


def model_source_check(*, model: Model, resolve: bool = True) -> tuple[str, str, str]:
    """Validate the model's weights source; return (source, revision, fingerprint). A hub
    source's revision is its pinned commit, resolved from the hub when the repo or revision is
    new (issue 28; `resolve` False never asks the hub, as a reload must not move a pin).

    Raises:
        ValidationError: keyed by the offending field, with a message for the admin form.
    """
    if model.source_kind == ModelInstance.SourceKind.HUB:
        repo = model.hf_repo.strip()
        if repo.count("/") != 1 or repo.startswith(("/", ".")) or ".." in repo:
            raise ValidationError({"hf_repo": HF_REPO_HELP})
        sha = hub_pins.hub_pin(model=model, resolve=resolve)
        return repo, sha, hub_fingerprint(repo, sha)
    if not model.local_path.strip():
        raise ValidationError({"local_path": "Choose a model folder under MODELS_ROOT."})
    try:
        folder = resolve_under(Path(settings.MODELS_ROOT), model.local_path.strip())
        validate_model_folder(folder)
    except InvalidModelFolderError as exc:
        raise ValidationError({"local_path": str(exc)}) from exc
    kv_format_check(model=model, folder=folder)
    relative = str(folder.relative_to(Path(settings.MODELS_ROOT).resolve()))
    return relative, "", folder_fingerprint(folder)


def instance_register(
    *, source_kind: str, source: str, revision: str, fingerprint: str, kv_format: str = ""
) -> ModelInstance:
    """The live instance for these exact weights served with this KV format, created with a fresh
    sequence id if new (REG-3): another KV format is another instance, with caches of its own."""
    instance = ModelInstance.objects.filter(
        source_kind=source_kind,
        source=source,
        revision=revision,
        fingerprint=fingerprint,
        kv_format=kv_format,
        retired_at__isnull=True,
    ).first()
    if instance is None:
        instance = ModelInstance.objects.create(
            source_kind=source_kind,
            source=source,
            revision=revision,
            fingerprint=fingerprint,
            kv_format=kv_format,
        )
    return instance


@transaction.atomic
def model_save(*, model: Model, actor: Actor = None) -> Model:
    """Validate and save `model`, registering the weights its source holds now (REG-2/3).

    `actor` is who saved it, for its admin history (ADM-6): None from the admin's change form,
    which records its own saves, and from scripts.

    Raises:
        ValidationError: the source or a setting is invalid.
    """
    source, revision, fingerprint = model_source_check(model=model)
    fingerprint = with_draft(fingerprint, model_draft_check(model=model))
    if model.source_kind == ModelInstance.SourceKind.LOCAL:
        model.local_path, model.hf_repo, model.hf_revision, model.hf_sha = source, "", "", ""
        # A local folder says what it is (API-13); a hub repo's kind is the staff's choice.
        model.kind = detect_kind(resolve_under(Path(settings.MODELS_ROOT), source))
    else:
        model.hf_repo, model.hf_revision = source, model.hf_revision.strip()
        model.hf_sha, model.local_path = revision, ""
    model.instance = instance_register(
        source_kind=model.source_kind,
        source=source,
        revision=revision,
        fingerprint=fingerprint,
        kv_format=model.kv_format,
    )
    model.full_clean()
    changes = audit_changes(model) if actor is not None else []
    model.save()
    audit_saved(actor=actor, obj=model, changes=changes)
    for target in Model.objects.filter(draft_model=model):  # their identity includes this one's
        model_save(model=target, actor=actor)
    control.notify_models_changed()  # on commit: engines in every process reconcile (ADM-3)
    return model


@transaction.atomic
def model_delete(*, model: Model) -> None:
    """Delete a model that no alias points at any more, and that drafts for no model.

    Raises:
        ValidationError: aliases still point at it (delete or move them first), or models name
            it as their draft.
    """
    names = list(model.aliases.values_list("name", flat=True))
    if names:
        raise ValidationError(
            f"{model.name} still serves {', '.join(names)}; move or delete those aliases first."
        )
    targets = list(Model.objects.filter(draft_model=model).values_list("name", flat=True))
    if targets:
        raise ValidationError(
            f"{model.name} is the draft model of {', '.join(targets)}; clear their draft first."
        )
    model.delete()
    control.notify_models_changed()


def model_fresh_instance(*, model: Model) -> ModelInstance:
    """The instance of the weights the model's source holds now (a new id if they changed),
    without switching the model to it: a reload loads it first (OPS-4).

    Raises:
        ValidationError: the source is no longer valid.
    """
    source, revision, fingerprint = model_source_check(model=model, resolve=False)
    fingerprint = with_draft(fingerprint, model_draft_check(model=model))
    return instance_register(
        source_kind=model.source_kind,
        source=source,
        revision=revision,
        fingerprint=fingerprint,
        kv_format=model.kv_format,
    )


def model_hub_update(*, model: Model, actor: Actor = None) -> hub_pins.HubUpdate:
    """Pin the model to the commit its revision names now, if it moved: a new instance, which the
    engines swap to as for any changed source (REG-4, REG-6); the old one serves until then.

    Raises:
        ValidationError: not a hub model, or the hub refuses.
    """
    update = hub_pins.model_hub_check(model=model)  # off the transaction: it waits on the network
    if update.moved:
        model.hf_sha, model.hub_pinned_for = (
            update.new_sha,
            (model.hf_repo.strip(), model.hf_revision.strip()),
        )
        model_save(model=model, actor=actor)
    return update


@transaction.atomic
def model_switch_instance(*, model: Model, instance: ModelInstance, requested_by: str = "") -> Model:
    """Point the model at `instance` (its reloaded weights are resident) and tell the engines.

    The switch goes into the model's history as done by `requested_by` (the reload's requester),
    once, however many engine processes ran the reload (ADM-6).
    """
    switched = (
        Model.objects.filter(pk=model.pk)
        .exclude(instance=instance)
        .update(instance=instance, updated_at=timezone.now())
    )
    model.instance = instance
    if switched:
        message = f"Reloaded: now serving instance #{instance.pk}."
        audit_record(actor=actor_named(requested_by), obj=model, message=message)
    control.notify_models_changed()
    return model


def model_request_action(
    *, model: Model, action: str, requested_by: str = "", actor: Actor = None, host: int | None = None
) -> None:
    """Ask the engines to load, unload or reload the model, through their writer path (ADM-1):
    every engine, or the fleet host `host` (a fleet-wide reload rolls host by host, issue 15). The
    request goes into the model's history as `actor`'s (ADM-6).

    Raises:
        ValidationError: the action is unknown.
    """
    if action not in control.ACTIONS:
        raise ValidationError(f"Unknown action {action!r}.")
    if actor is not None and actor.is_authenticated and not requested_by:
        requested_by = actor.get_username()
    with transaction.atomic():
        checked = cast("control.Action", action)  # one of control.ACTIONS, checked above
        control.request_action(model_name=model.name, action=checked, requested_by=requested_by, host=host)
        where = f" on h{host:02d}" if host is not None else ""
        audit_record(actor=actor, obj=model, message=f"Requested {action}{where}.")


@transaction.atomic
def alias_save(*, alias: ModelAlias, actor: Actor = None) -> ModelAlias:
    """Validate and save `alias` (its name, sampling and limits); engines reconcile on commit.
    `actor` is as for `model_save` (ADM-6).

    Raises:
        ValidationError: a setting is invalid.
    """
    adapters.alias_adapter_check(alias=alias)  # its adapter is its model's (issue 28)
    alias.full_clean()
    changes = audit_changes(alias) if actor is not None else []
    alias.save()
    audit_saved(actor=actor, obj=alias, changes=changes)
    control.notify_models_changed()
    return alias


@transaction.atomic
def alias_delete(*, alias: ModelAlias) -> None:
    """Delete the alias; engines unbind it, and its model's weights stay for its other aliases."""
    alias.delete()
    control.notify_models_changed()


@transaction.atomic
def alias_register(*, name: str, model_name: str = "", **fields: Any) -> ModelAlias:
    """Create or update the alias `name` and the model of the weights it names, in one step.

    `fields` may mix alias fields (sampling, limits) and model fields (source, lane, memory):
    the model is found by its source (or created, called `model_name` or the alias's name), the
    model fields given are applied to it, and the alias points at it. For scripts, the demo and
    tests; the admin edits the two separately.
    """
    model_fields = {key: fields.pop(key) for key in list(fields) if key in MODEL_ONLY_FIELDS}
    alias = ModelAlias.objects.select_related("model").filter(name=name).first() or ModelAlias(name=name)
    model = _model_for_source(model_fields, current=alias.model if alias.pk else None)
    if model.pk is None:
        model.name = free_model_name(model_name or name)
    for field, value in model_fields.items():
        setattr(model, field, value)
    if model.pk is None or model_fields:
        model_save(model=model)
    alias.model = model
    for field, value in fields.items():
        setattr(alias, field, value)
    return alias_save(alias=alias)


MODEL_SOURCE_FIELDS = ("source_kind", "local_path", "hf_repo", "hf_revision")
MODEL_ONLY_FIELDS = frozenset(
    (*MODEL_SOURCE_FIELDS, "pinned", "keep_alive_s", "concurrency", "queue_depth", "queue_unbounded",
     "queue_timeout_s", "kind", "matryoshka", "kv_bits", "kv_group_size", "kv_quantized_start",
     "draft_model")
)  # fmt: skip


def _model_for_source(model_fields: dict[str, Any], *, current: Model | None) -> Model:
    if not any(field in model_fields for field in MODEL_SOURCE_FIELDS):
        if current is None:
            raise ValidationError("A new alias needs a weights source (local_path or hf_repo).")
        return current
    kind = model_fields.get("source_kind", ModelInstance.SourceKind.LOCAL)
    source = {"source_kind": kind, "local_path": "", "hf_repo": "", "hf_revision": ""}
    source.update({key: str(model_fields.get(key, "")).strip() for key in MODEL_SOURCE_FIELDS[1:]})
    if kind == ModelInstance.SourceKind.LOCAL and source["local_path"]:
        # Stored relative and normalised (model_save), so look it up the same way.
        try:
            folder = resolve_under(Path(settings.MODELS_ROOT), source["local_path"])
            source["local_path"] = str(folder.relative_to(Path(settings.MODELS_ROOT).resolve()))
        except (InvalidModelFolderError, ValueError):
            pass  # model_save reports it, keyed by the field
    model_fields.update(source)
    return Model.objects.filter(**source).first() or Model()


def free_model_name(wanted: str) -> str:
    """`wanted`, or `wanted-2`, `wanted-3`, ...: the first name no Model has yet."""
    name, n = wanted, 2
    while Model.objects.filter(name=name).exists():
        name, n = f"{wanted}-{n}", n + 1
    return name


def apikey_create(
    *,
    owner: User,
    name: str,
    requests_per_minute: int | None = None,
    tokens_per_day: int | None = None,
    actor: Actor = None,
) -> tuple[ApiKey, str]:
    """Create a key, with optional limits (KEY-4); returns the row and the full key, which is
    never retrievable again (KEY-1). `actor` is who created it, for its history (ADM-6); the
    admin's add form records its own."""
    raw = key_generate()
    key = ApiKey(
        owner=owner,
        name=name,
        prefix=key_prefix(raw),
        secret_hash=key_hash(raw),
        requests_per_minute=requests_per_minute,
        tokens_per_day=tokens_per_day,
    )
    key.full_clean()
    key.save()
    audit_saved(actor=actor, obj=key, changes=ADDED if actor is not None else [])
    _forget_cached_keys()  # an attempt with this key a moment ago may have cached a refusal
    return key, raw


def apikey_update(
    *, key: ApiKey, name: str, requests_per_minute: int | None, tokens_per_day: int | None
) -> ApiKey:
    """Rename a key or change its limits: in force at once in this process, within
    `hotcache.KEY_TTL_S` in others (their cached identity carries the limits).

    Raises:
        ValidationError: a value is invalid.
    """
    key.name, key.requests_per_minute, key.tokens_per_day = name, requests_per_minute, tokens_per_day
    key.full_clean()
    key.save(update_fields=["name", "requests_per_minute", "tokens_per_day", "updated_at"])
    _forget_cached_keys()
    return key


def apikey_ensure(*, owner: User, raw_key: str, name: str) -> ApiKey:
    """Make sure a live key with exactly this value exists for `owner` (bootstrap from the environment).

    Raises:
        ValidationError: the key is too short to be a secret.
    """
    if len(raw_key) < 16:
        raise ValidationError("MLXHOST_BOOTSTRAP_API_KEY must be at least 16 characters.")
    key, _ = ApiKey.objects.update_or_create(
        prefix=key_prefix(raw_key),
        defaults={"owner": owner, "name": name, "secret_hash": key_hash(raw_key), "revoked_at": None},
    )
    _forget_cached_keys()
    return key


def apikey_revoke(*, key: ApiKey, actor: Actor = None) -> ApiKey:
    """Revoke `key`: refused at once in this process, within `hotcache.KEY_TTL_S` in others, and
    its open WebSockets close with 4401 once this commits (API-5); recorded as `actor`'s (ADM-6)."""
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at", "updated_at"])
    audit_record(actor=actor, obj=key, message="Revoked.")
    _forget_cached_keys()
    control.sockets_close_on_commit(group=control.apikey_group(key.pk))
    return key


def _forget_cached_keys() -> None:
    # Now, and again on commit: a lookup between the two would have read the old row.
    hotcache.api_keys.clear()
    transaction.on_commit(hotcache.api_keys.clear)


def responses_purge_expired() -> int:
    """Delete stored responses past their expiry; idempotent. Returns how many rows went."""
    expired = StoredResponse.objects.filter(expires_at__lt=timezone.now())
    saved_kv_forget(list(expired.values_list("public_id", flat=True)))
    deleted, _ = expired.delete()
    return deleted


def saved_kv_forget(public_ids: list[str]) -> None:
    """Delete the disk tier's files of these responses once the transaction commits: a response
    that is gone (deleted, expired, tombstoned unlanded) leaves no KV behind."""
    if public_ids:
        transaction.on_commit(lambda: remove_saved(settings.MLXHOST_KV_DIR, public_ids))


def response_retention(*, retention_s: int | None) -> timedelta:
    """How long a stored response is kept: the request's override clamped to the allowed range (PER-5).

    None or 0 means "no override": the default, MLXHOST_RESPONSE_RETENTION_S.
    """
    if not retention_s or retention_s < 0:
        retention_s = settings.MLXHOST_RESPONSE_RETENTION_S
    low, high = settings.MLXHOST_RESPONSE_RETENTION_MIN_S, settings.MLXHOST_RESPONSE_RETENTION_MAX_S
    return timedelta(seconds=max(low, min(int(retention_s), high)))


def response_persist(*, payload: dict[str, Any]) -> StoredResponse | None:
    """Write the row a finished turn produced; idempotent, keyed by its public id (PER-1).

    `payload` is `persistence.ResponseRecord.as_payload()`. A second call for the same id (a
    redelivered task, an inline write racing the worker) changes nothing and returns the
    existing row. Returns None when the owner no longer exists (nothing to keep).
    """
    public_id = payload["public_id"]
    existing = StoredResponse.objects.filter(public_id=public_id).first()
    if existing is not None:
        return existing
    if not get_user_model().objects.filter(pk=payload["owner_id"]).exists():
        logger.warning("response %s not stored: its owner was deleted", public_id)
        return None
    alias_id = payload.get("alias_id")
    if alias_id is not None and not ModelAlias.objects.filter(pk=alias_id).exists():
        alias_id = None  # the alias was deleted meanwhile; alias_name keeps the label
    created_at = datetime.fromtimestamp(payload["created_at"], tz=UTC)
    with transaction.atomic():
        # get_or_create catches the IntegrityError of a concurrent insert and returns that row.
        row, created = StoredResponse.objects.get_or_create(
            public_id=public_id,
            defaults={
                "owner_id": payload["owner_id"],
                "alias_id": alias_id,
                "alias_name": payload["alias_name"],
                "instance_id": payload["instance_id"],
                "weights_fingerprint": payload["weights_fingerprint"],
                "boot_id": payload["boot_id"],
                "previous_response_id": payload.get("previous_response_id") or "",
                "request": payload.get("request") or {},
                "output": payload.get("output") or [],
                "output_text": payload.get("output_text") or "",
                "usage": payload.get("usage") or {},
                "status": payload["status"],
                "expires_at": created_at + response_retention(retention_s=payload.get("retention_s")),
            },
        )
        if created:
            # auto_now_add stamps the landing time; the response was created when the turn ran.
            StoredResponse.objects.filter(pk=row.pk).update(created_at=created_at)
            row.created_at = created_at
    return row


def response_delete(*, public_id: str, owner_id: int) -> bool:
    """Delete the caller's stored response (PER-6: scoped to its owner). Returns whether one went."""
    deleted, _ = StoredResponse.objects.filter(public_id=public_id, owner_id=owner_id).delete()
    if deleted:
        saved_kv_forget([public_id])
    return deleted > 0


def tombstone_record(
    *, instance_id: int, weights_key: tuple[str, ...] | list[str], public_id: str
) -> InstanceTombstone:
    """Record that the persist breaker gave up waiting for `public_id`'s row (PER-4, REG-7)."""
    source, revision, fingerprint = weights_key[:3]
    return InstanceTombstone.objects.create(
        instance_id=instance_id,
        source=source,
        revision=revision,
        fingerprint=fingerprint,
        response_public_id=public_id,
        expires_at=timezone.now() + timedelta(seconds=runtime_settings().persistence.tombstone_ttl_s),
    )


def tombstones_purge() -> int:
    """Delete tombstones whose row has landed or that expired; idempotent. Returns how many went."""
    landed = StoredResponse.objects.filter(public_id=OuterRef("response_public_id"))
    unlanded = InstanceTombstone.objects.filter(expires_at__lt=timezone.now()).exclude(Exists(landed))
    saved_kv_forget(list(unlanded.values_list("response_public_id", flat=True)))
    deleted, _ = InstanceTombstone.objects.filter(
        Q(expires_at__lt=timezone.now()) | Q(Exists(landed))
    ).delete()
    return deleted
