"""Celery tasks: thin wrappers that call services with ids and JSON primitives only."""

from __future__ import annotations

from typing import Any

from django.db import OperationalError

from mlxhost.celery import task


# acks_late + an idempotent upsert: a worker killed mid-task gets the task redelivered, and the
# second run finds the row (or writes it once); never a duplicate (PER-1, PER-3).
@task(
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def response_persist(payload: dict[str, Any]) -> None:
    from models_app.services import response_persist as persist

    persist(payload=payload)


@task(acks_late=True)
def responses_purge_expired() -> int:
    from models_app.services import responses_purge_expired as purge

    return purge()


@task(acks_late=True)
def tombstones_purge() -> int:
    from models_app.services import tombstones_purge as purge

    return purge()
