"""The dashboard's chart history (ADM-2): a sample of each engine's instances every
HISTORY_EVERY_S seconds over the last HISTORY_S, so a dashboard opened after an incident shows it.

It lives where the engines' status lives: in Redis when `REDIS_URL` is set (one list per engine
process, shared by every process of a fleet), else in the process's own cache, which is the engine
process's: a single daphne serves both the engine and the dashboard. Written by the status
publisher only; read by the dashboard view."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.cache import cache

from models_app.catalogue import control

HISTORY_KEY = "engine-status-history:{boot_id}"
HISTORY_S = 3600  # the last hour
HISTORY_EVERY_S = 5.0  # one sample per engine every 5 s: 720 an hour
HISTORY_SAMPLES = int(HISTORY_S / HISTORY_EVERY_S)
# What a chart draws of an instance view (dashboard.js `sample`); the rest of a view is not kept.
SAMPLE_FIELDS = (
    "instance_id",
    "live_state",
    "tokens_per_s",
    "queued",
    "active",
    "ttft_ms",
    "queue_ms",
    "memory_bytes",
    "warm_bytes",
    "cache_hit_rate",
)

_last_sample_at: dict[str, float] = {}  # boot id -> when this process last kept a sample


def history_record(status: dict[str, Any]) -> None:
    """Keep a sample of `status` if the engine's last one is HISTORY_EVERY_S old (the publisher)."""
    boot_id, at = status["boot_id"], float(status["at"])
    if at - _last_sample_at.get(boot_id, 0.0) < HISTORY_EVERY_S:
        return
    _last_sample_at[boot_id] = at
    sample = {
        "at": at,
        "instances": [{f: view.get(f) for f in SAMPLE_FIELDS} for view in status["instances"]],
    }
    key = HISTORY_KEY.format(boot_id=boot_id)
    redis = control._redis_client()
    if redis is not None:
        full = cache.make_key(key)
        pipe = redis.pipeline()
        pipe.rpush(full, json.dumps(sample, allow_nan=False))
        pipe.ltrim(full, -HISTORY_SAMPLES, -1)
        pipe.expire(full, HISTORY_S)
        pipe.execute()
        return
    samples: list[dict[str, Any]] = cache.get(key) or []
    samples.append(sample)
    cache.set(key, samples[-HISTORY_SAMPLES:], HISTORY_S)


def history_of(*, boot_ids: list[str], now: float | None = None) -> dict[str, list[dict[str, Any]]]:
    """The samples of the last HISTORY_S seconds of each engine in `boot_ids`, oldest first."""
    since = (time.time() if now is None else now) - HISTORY_S
    redis = control._redis_client()
    found: dict[str, list[dict[str, Any]]] = {}
    for boot_id in boot_ids:
        key = HISTORY_KEY.format(boot_id=boot_id)
        if redis is not None:
            samples = [json.loads(raw) for raw in redis.lrange(cache.make_key(key), 0, -1)]
        else:
            samples = cache.get(key) or []
        found[boot_id] = [sample for sample in samples if sample["at"] >= since]
    return found
