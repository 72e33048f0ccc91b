"""Asking for a quantized copy (issue 28, item 2): checks, the row, and its hand-off to the task.

The run itself (the task's body) is `quantize_job`'s.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from django.core.exceptions import ValidationError
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from mlxhost.engine import QUANT_BITS, QUANT_GROUP_SIZES
from models_app.catalogue.audit import audit_record
from models_app.catalogue.quantize_job import QUANTIZED_DIR, copy_name
from models_app.models import Model, ModelInstance, QuantizedCopy

if TYPE_CHECKING:
    from models_app.catalogue.audit import Actor

ONLY_LOCAL = "Only a local folder can be quantized here; register the hub model's folder first."
ONLY_CHAT = "Only chat models can be quantized here (mlx-lm quantizes language models)."
INTERRUPTED = "Interrupted: the process that was making it stopped."
IN_FLIGHT_STATUSES = (QuantizedCopy.Status.QUEUED, QuantizedCopy.Status.RUNNING)
IN_FLIGHT = "A {bits}-bit copy of {name} with group size {group} is already being made."


def quantized_copy_request(*, model: Model, bits: int, group_size: int, actor: Actor = None) -> QuantizedCopy:
    """Queue a quantized copy of `model`; the task starts once this transaction commits.

    Raises:
        ValidationError: not a local chat model, settings out of range, or the same copy in flight.
    """
    if bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES:
        raise ValidationError(
            f"Choose 4 or 8 bits and a group size of {', '.join(map(str, QUANT_GROUP_SIZES))}."
        )
    if model.source_kind != ModelInstance.SourceKind.LOCAL:
        raise ValidationError(ONLY_LOCAL)
    if model.kind != Model.Kind.CHAT:
        raise ValidationError(ONLY_CHAT)
    folder = f"{QUANTIZED_DIR}/{copy_name(model=model, bits=bits, group_size=group_size)}"
    _forget_interrupted(model=model, bits=bits, group_size=group_size)
    try:
        with transaction.atomic():
            copy = QuantizedCopy.objects.create(source=model, bits=bits, group_size=group_size, folder=folder)
            audit_record(
                actor=actor, obj=model, message=f"Requested a {bits}-bit copy (group size {group_size})."
            )
    except IntegrityError as exc:  # quantized_copy_one_in_flight
        raise ValidationError(IN_FLIGHT.format(bits=bits, name=model.name, group=group_size)) from exc
    copy_id = copy.pk
    transaction.on_commit(lambda: quantized_copy_dispatch(copy_id=copy_id))
    return copy


def _forget_interrupted(*, model: Model, bits: int, group_size: int) -> None:
    # Without a broker a copy runs in a thread of this process (the only one then), which a restart
    # ends with its row still in flight: that row is failed, so the copy can be asked for again.
    # With a broker the worker's redelivery (acks_late) finishes it instead.
    from models_app.catalogue.tasks import model_quantize as model_quantize_task

    if not model_quantize_task.app.conf.task_always_eager:
        return
    running = {thread.name for thread in threading.enumerate()}
    for copy in QuantizedCopy.objects.filter(
        source=model, bits=bits, group_size=group_size, status__in=IN_FLIGHT_STATUSES
    ):
        if _thread_name(copy.pk) not in running:
            QuantizedCopy.objects.filter(pk=copy.pk, status__in=IN_FLIGHT_STATUSES).update(
                status=QuantizedCopy.Status.FAILED, error=INTERRUPTED, finished_at=timezone.now()
            )


def _thread_name(copy_id: int) -> str:
    return f"mlxhost-quantize-{copy_id}"


def quantized_copy_dispatch(*, copy_id: int) -> None:
    """Hand the copy to a Celery worker; without a broker (eager mode), to a thread of its own,
    so the admin's request returns at once and the page can follow the stages."""
    from models_app.catalogue.tasks import model_quantize as model_quantize_task

    if not model_quantize_task.app.conf.task_always_eager:
        model_quantize_task.delay(copy_id)
        return
    threading.Thread(target=_run_eagerly, args=(copy_id,), name=_thread_name(copy_id), daemon=True).start()


def _run_eagerly(copy_id: int) -> None:
    from mlxhost.engine.backends.mlx.quantize import release_thread
    from models_app.catalogue.tasks import model_quantize as model_quantize_task

    try:
        model_quantize_task.apply(args=[copy_id], throw=False)  # the task records its own failure on the row
    finally:
        connections.close_all()  # this thread's connections only
        release_thread()
