"""Celery tasks: thin wrappers that call services with ids and JSON primitives only.

Each keeps the name it had as `models_app.tasks.*`: names are stored in the broker and the beat schedule."""

from __future__ import annotations

from typing import Any

from django.db import OperationalError

from mlxhost.celery import task


# acks_late + an idempotent upsert: a worker killed mid-task gets the task redelivered, and the
# second run finds the row (or writes it once); never a duplicate (PER-1, PER-3).
@task(
    name="models_app.tasks.response_persist",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def response_persist(payload: dict[str, Any]) -> None:
    from models_app.catalogue.services import response_persist as persist

    persist(payload=payload)


@task(name="models_app.tasks.responses_purge_expired", acks_late=True)
def responses_purge_expired() -> int:
    from models_app.catalogue.services import responses_purge_expired as purge

    return purge()


@task(name="models_app.tasks.tombstones_purge", acks_late=True)
def tombstones_purge() -> int:
    from models_app.catalogue.services import tombstones_purge as purge

    return purge()
