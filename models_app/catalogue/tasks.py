"""Celery tasks of the catalogue: making a quantized copy of a model (issue 28, item 2)."""

from __future__ import annotations

from django.db import OperationalError

from mlxhost.celery import task


# acks_late: a worker killed mid-copy gets the task redelivered; the run is idempotent (a finished
# row is left alone, and a folder already built from the same source and settings is reused).
@task(
    name="models_app.tasks.model_quantize",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=3,
)
def model_quantize(copy_id: int) -> None:
    from models_app.catalogue.quantize_job import quantized_copy_run

    quantized_copy_run(copy_id=copy_id)
