"""LoRA adapters of a base Model (issue 28): the check at save, saving and deleting, which folders the admin
offers, an alias's adapter check, and the adapter an alias's requests carry to the engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from mlxhost.engine import (
    ADAPTER_FILES,
    AdapterRef,
    InvalidAdapterError,
    InvalidModelFolderError,
    adapter_fingerprint,
    check_against_base,
    read_adapter,
    resolve_under,
)
from models_app.catalogue import control
from models_app.catalogue.audit import audit_changes, audit_saved
from models_app.models import Adapter, Model, ModelAlias, ModelInstance

if TYPE_CHECKING:
    from models_app.catalogue.audit import Actor

ADAPTER_FOLDER_DEPTH = 3  # MODELS_ROOT/adapters/<owner>/<name> at most
WRONG_BASE = "The adapter {adapter} belongs to {base}, not to {model}: choose an adapter of {model}, or none."
HUB_BASE = (
    "The base model {base} is a Hugging Face repo: an adapter needs a local base folder to be checked "
    "against (download the base under MODELS_ROOT and register it as a folder)."
)


def adapter_folder(adapter: Adapter) -> Path:
    """The adapter's absolute folder (inside MODELS_ROOT).

    Raises:
        ValidationError: on `local_path`, the path leaves MODELS_ROOT.
    """
    try:
        return resolve_under(Path(settings.MODELS_ROOT), adapter.local_path.strip())
    except InvalidModelFolderError as exc:
        raise ValidationError({"local_path": str(exc)}) from exc


def adapter_check(*, adapter: Adapter) -> None:
    """Check the folder against its base (layer names, shapes, rank) and record what it holds:
    fingerprint, rank, scale, layers and bytes, on `adapter` (not saved).

    Raises:
        ValidationError: on the field it concerns, saying what does not fit.
    """
    base = adapter.base
    if base.source_kind != ModelInstance.SourceKind.LOCAL:
        raise ValidationError({"base": HUB_BASE.format(base=base.name)})
    if base.kind != Model.Kind.CHAT:
        raise ValidationError({"base": f"{base.name} is an embedding model; adapters apply to chat models."})
    folder = adapter_folder(adapter)
    try:
        info = read_adapter(folder)
        check_against_base(info, resolve_under(Path(settings.MODELS_ROOT), base.local_path))
    except (InvalidAdapterError, InvalidModelFolderError) as exc:
        raise ValidationError({"local_path": str(exc)}) from exc
    adapter.local_path = adapter.local_path.strip()
    adapter.fingerprint = adapter_fingerprint(folder)
    adapter.rank, adapter.scale, adapter.layers = info.rank, info.scale, len(info.layers)
    adapter.nbytes = sum((folder / name).stat().st_size for name in ADAPTER_FILES)


@transaction.atomic
def adapter_save(*, adapter: Adapter, actor: Actor = None) -> Adapter:
    """Check and save `adapter`; engines reconcile on commit (an alias of it then serves the new files).

    Raises:
        ValidationError: the folder does not fit the base, or a field is invalid.
    """
    adapter_check(adapter=adapter)
    adapter.full_clean()
    changes = audit_changes(adapter) if actor is not None else []
    adapter.save()
    audit_saved(actor=actor, obj=adapter, changes=changes)
    control.notify_models_changed()
    return adapter


@transaction.atomic
def adapter_delete(*, adapter: Adapter) -> None:
    """Delete an adapter that no alias uses (PROTECT refuses otherwise)."""
    adapter.delete()
    control.notify_models_changed()


def adapter_base_error(adapter: Adapter | None, model: Model | None) -> str | None:
    """Why `adapter` cannot serve an alias of `model` (None: it can, or there is none)."""
    if adapter is None or model is None or adapter.base_id == model.pk:
        return None
    return WRONG_BASE.format(adapter=adapter.name, base=adapter.base.name, model=model.name)


def alias_adapter_check(*, alias: ModelAlias) -> None:
    """An alias's adapter must be one of its model's.

    Raises:
        ValidationError: on `adapter`, naming both models.
    """
    error = adapter_base_error(alias.adapter, alias.model)
    if error is not None:
        raise ValidationError({"adapter": error})


def adapter_ref_for(alias: ModelAlias) -> AdapterRef | None:
    """What the engine needs of an alias's adapter (loaded with the alias: no query here)."""
    adapter = alias.adapter
    if adapter is None:
        return None
    folder = Path(settings.MODELS_ROOT) / adapter.local_path
    return AdapterRef(key=adapter.fingerprint, name=adapter.name, path=str(folder.resolve()))


def adapter_folders_available(*, root: Path | None = None) -> list[str]:
    """Folders under MODELS_ROOT holding adapter_config.json and adapters.safetensors (what the admin offers)."""
    root = (root or Path(settings.MODELS_ROOT)).resolve()
    found: list[str] = []
    pending = [(root, 0)] if root.is_dir() else []
    while pending:
        folder, depth = pending.pop()
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            continue
        for child in children:
            if child.resolve() != root and root not in child.resolve().parents:
                continue  # a symlink out of the root
            if all((child / name).is_file() for name in ADAPTER_FILES):
                found.append(child.relative_to(root).as_posix())
            elif depth + 1 < ADAPTER_FOLDER_DEPTH:
                pending.append((child, depth + 1))
    return sorted(found)
