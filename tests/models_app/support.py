"""Helpers shared by the persistence tests (unit and Celery integration): records and off-loop ORM calls."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from django.db import connections

from mlxhost.runtime.config import PersistenceSettings
from models_app.persistence.persistence import Persistence, ResponseRecord
from models_app.persistence.records import StoreWiring

_SETTINGS = {field.name for field in dataclasses.fields(PersistenceSettings)}


def build_persistence(**options) -> Persistence:
    """A `Persistence` from keyword options: the settings' fields (`poll_s`, `hard_timeout_s`, …)
    and the wiring's (`publish`, `eager`, `clock`, `shared`, `late_limit`, …)."""
    config = PersistenceSettings(**{k: v for k, v in options.items() if k in _SETTINGS})
    return Persistence(config, StoreWiring(**{k: v for k, v in options.items() if k not in _SETTINGS}))


def make_record(owner_id: int, *, text: str = "Hello there.", **overrides) -> ResponseRecord:
    fields = {
        "public_id": f"resp_{uuid.uuid4().hex}",
        "owner_id": owner_id,
        "alias_id": None,
        "alias_name": "tiny",
        "instance_id": 7,
        "weights_fingerprint": "f" * 64,
        "weights_key": ["/models/fake-1", "", "f" * 64],
        "boot_id": "b" * 32,
        "request": {"input": [{"role": "user", "content": "Hi"}]},
        "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
        "output_text": text,
        "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        **overrides,
    }
    return ResponseRecord(**fields)


def drop(payload: dict) -> None:
    """A broker that accepts the task and loses it: the row never lands unless a test writes it."""


def off_loop(fn):
    """`fn` as a coroutine run in a fresh thread that closes its connections (else PostgreSQL's
    test database cannot be dropped: asgiref's thread would keep a session open)."""

    async def call(*args, **kwargs):
        def run():
            try:
                return fn(*args, **kwargs)
            finally:
                connections.close_all()

        return await asyncio.to_thread(run)

    return call
