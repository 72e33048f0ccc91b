"""A quantized copy's run (issue 28, item 2): the Celery task `model_quantize`'s body, idempotent.

mlx-lm's quantization runs in `mlxhost.engine.backends.mlx.quantize`; the copy is written into
`MODELS_ROOT/quantized/<name>/` and registered as a new local Model with its own fingerprint. A
failure at any stage leaves the row `failed` with its message, no Model and no folder.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from mlxhost.engine import InvalidModelFolderError, QuantizationError, folder_fingerprint, resolve_under
from models_app.catalogue import services
from models_app.catalogue.audit import audit_record
from models_app.models import Model, ModelInstance, QuantizedCopy

if TYPE_CHECKING:
    from mlxhost.engine.backends.mlx.quantize import QuantizedCopy as MadeCopy

logger = logging.getLogger(__name__)

QUANTIZED_DIR = "quantized"  # the managed folder under MODELS_ROOT
# The lane and memory settings a copy starts with: the original's.
INHERITED_FIELDS = ("concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s", "keep_alive_s")


def copy_name(*, model: Model, bits: int, group_size: int) -> str:
    """The copy's folder and Model name: the original's name with its settings, e.g. `tiny-4bit-g64`."""
    suffix = f"-{bits}bit-g{group_size}"
    return model.name[: 64 - len(suffix)] + suffix


def quantized_copy_run(*, copy_id: int) -> QuantizedCopy | None:
    """Make the copy `copy_id` asked for and register it: the task's body, idempotent.

    A row already done or failed (a redelivered task) is left as it is. Every failure is recorded
    on the row with a message for the admin; nothing half-made stays (no Model, no folder).
    """
    from mlxhost.engine.backends.mlx.quantize import quantize_folder

    copy = QuantizedCopy.objects.select_related("source").filter(pk=copy_id).first()
    if copy is None or copy.status in (QuantizedCopy.Status.DONE, QuantizedCopy.Status.FAILED):
        return copy
    _set(copy, status=QuantizedCopy.Status.RUNNING, stage="", error="")
    root = Path(settings.MODELS_ROOT)
    try:
        source = resolve_under(root, copy.source.local_path)
        dest = resolve_under(root, copy.folder)
        made = quantize_folder(
            source,
            dest,
            bits=copy.bits,
            group_size=copy.group_size,
            source_fingerprint=folder_fingerprint(source),  # the bytes there now, whatever was registered
            on_stage=lambda stage: _set(copy, stage=stage),
        )
        _set(copy, stage=QuantizedCopy.Stage.REGISTERING)
        _register(copy, made)
    except (QuantizationError, InvalidModelFolderError, ValidationError) as exc:
        _fail(copy, _message(exc))
    except Exception as exc:
        _fail(copy, f"Unexpected error: {exc}")
        raise
    return copy


def _register(copy: QuantizedCopy, made: MadeCopy) -> None:
    """The copy's Model and the row's measurements, in one transaction (never a half-registered Model)."""
    source = copy.source
    with transaction.atomic():
        model = Model.objects.filter(
            source_kind=ModelInstance.SourceKind.LOCAL, local_path=copy.folder
        ).first()
        if model is None:
            model = Model(
                name=services.free_model_name(
                    copy_name(model=source, bits=copy.bits, group_size=copy.group_size)
                ),
                description=f"{copy.bits}-bit copy of {source.name} (group size {copy.group_size})"[:200],
                source_kind=ModelInstance.SourceKind.LOCAL,
                local_path=copy.folder,
                **{field: getattr(source, field) for field in INHERITED_FIELDS},
            )
            services.model_save(model=model)
        _set(
            copy,
            status=QuantizedCopy.Status.DONE,
            stage="",
            result=model,
            finished_at=timezone.now(),
            quantized_layers=made.quantized_layers,
            source_bytes=made.source.weights_bytes,
            source_load_s=made.source.load_s,
            source_tokens_per_s=made.source.tokens_per_s,
            copy_bytes=made.copy.weights_bytes,
            copy_load_s=made.copy.load_s,
            copy_tokens_per_s=made.copy.tokens_per_s,
        )
        audit_record(actor=None, obj=source, message=f"Made a quantized copy: {model.name}.")


def _fail(copy: QuantizedCopy, message: str) -> None:
    logger.warning("quantized copy %s failed: %s", copy.pk, message)
    if not Model.objects.filter(local_path=copy.folder).exists():  # a registered folder is served: keep it
        _remove_folder(copy.folder)
    _set(copy, status=QuantizedCopy.Status.FAILED, error=message, finished_at=timezone.now())


def _remove_folder(relative: str) -> None:
    from mlxhost.engine.backends.mlx.tiny import MARKER_NAME

    try:
        folder = resolve_under(Path(settings.MODELS_ROOT), relative)
    except InvalidModelFolderError:
        return
    if (folder / MARKER_NAME).is_file():  # only a folder mlxhost built
        shutil.rmtree(folder, ignore_errors=True)


def _set(copy: QuantizedCopy, *, result: Model | None = None, **fields: object) -> None:
    # `update`, not `save`: the admin shows each stage as it begins, and nothing else is rewritten.
    if result is not None:
        copy.result = result
        fields["result_id"] = result.pk
    for name, value in fields.items():
        setattr(copy, name, value)
    QuantizedCopy.objects.filter(pk=copy.pk).update(**fields, updated_at=timezone.now())


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "The copy could not be registered: " + "; ".join(exc.messages)
    return str(exc)
