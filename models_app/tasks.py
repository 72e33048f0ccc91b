"""Celery tasks: thin wrappers that call services with ids and JSON primitives only."""

from __future__ import annotations

from mlxhost.celery import app


@app.task(acks_late=True)
def responses_purge_expired() -> int:
    from models_app.services import responses_purge_expired as purge

    return purge()
