"""The live status (ADM-2, OPS-2, OPS-4): each instance's state and label, published once a second.

The one place that names an instance's state. `instance_status` is OPS-2's health ladder (the
/readyz probe uses it); `instance_live_state` is the state the admin and the dashboard show,
published with its words (`models_app.control.LIVE_LABELS`) so that the admin, the dashboard
view and `dashboard.js` only render `view["label"]`. `run_status_publisher` reports every
instance to the cache (the admin reads it) and to the dashboard group (pushed to the browsers).
Registered on import: the publisher runs from the engine's start until it stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from mlxhost.runtime import lifecycle
from mlxhost.runtime.control import Actions, actions_for, is_alias
from models_app import control

if TYPE_CHECKING:
    from mlxhost.engine import Engine

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0
STARTED_AT = time.time()


def instance_status(snap: dict[str, Any]) -> str:
    """OPS-2's ladder: ok | loading | degraded (saturated queue, stuck generation, failures
    since the last clean generation) | error | unloaded."""
    state = snap["state"]
    faulted = snap["faults"]["in_a_row"] > 0
    if state == "ready" and (
        not snap["worker_alive"] or snap["stalled"] or snap["lane"]["saturated"] or faulted
    ):
        return "degraded"
    return {"ready": "ok", "loading": "loading", "error": "error"}.get(state, "unloaded")


def instance_live_state(*, state: str, status: str, draining: bool) -> str:
    """What the admin and the dashboard call an instance in engine `state`, with OPS-2 `status`:
    a key of `control.LIVE_LABELS` (unloaded, loading, resident, degraded, draining, error)."""
    if draining and state in ("ready", "unloaded"):
        return "draining"
    if state == "ready":
        return "degraded" if status == "degraded" else "resident"
    if state in ("loading", "error"):
        return state
    return "unloaded"


def live_fields(*, state: str, status: str, draining: bool) -> dict[str, str]:
    """The published `live_state` and its `label`, the words every page renders as they are."""
    live_state = instance_live_state(state=state, status=status, draining=draining)
    return {"live_state": live_state, "label": control.LIVE_LABELS[live_state]}


class StatusBuilder:
    """Turns engine snapshots into the status the admin and dashboard show, with rates over time."""

    def __init__(self, engine: Engine, actions: Actions) -> None:
        self.engine = engine
        self.actions = actions
        self._last: dict[int, tuple[int, float]] = {}  # instance id -> (tokens generated, when)

    def build(self) -> dict[str, Any]:
        now = time.monotonic()
        views = [self._view(snap, now) for snap in self.engine.snapshot()]
        return {
            "boot_id": lifecycle.BOOT_ID,
            "host": socket.gethostname(),
            "host_id": settings.MLXHOST_HOST_ID,  # in a fleet: this host's number
            "pid": os.getpid(),
            "started_at": STARTED_AT,
            "at": time.time(),
            "instances": sorted(views, key=lambda view: view["instance_id"]),
            "actions": dict(self.actions.results),
        }

    def _view(self, snap: dict[str, Any], now: float) -> dict[str, Any]:
        instance_id, tokens = snap["instance_id"], snap["tokens_generated"]
        last_tokens, last_at = self._last.get(instance_id, (tokens, now))
        self._last[instance_id] = (tokens, now)
        elapsed = now - last_at
        lane, progress = snap["lane"], snap["load_progress"]
        cache, disk = snap["prefix_cache"]["memory"], snap["prefix_cache"].get("disk")
        status = instance_status(snap)
        return {
            "instance_id": instance_id,
            "aliases": [name for name in snap["aliases"] if is_alias(name)],
            "state": snap["state"],
            "status": status,
            **live_fields(state=snap["state"], status=status, draining=lane["draining"]),
            "error": snap["last_error"] or "",
            "active": lane["active"],
            "queued": lane["queued"],
            "capacity": lane["capacity"],
            "draining": lane["draining"],
            "tokens_per_s": round((tokens - last_tokens) / elapsed, 1) if elapsed > 0 else 0.0,
            "decode_tps": snap["decode_tps"],
            "ttft_ms": snap["ttft_ms"],
            "batch_size": snap["batch_size"],
            "warm_sessions": cache["entries"],
            "warm_bytes": cache["bytes"],
            "cache_hit_rate": cache["hit_rate"],
            "cache_tokens_saved": cache["tokens_saved"],
            # The disk tier (SES-9), when it is on: None otherwise.
            "disk_entries": disk["entries"] if disk else None,
            "disk_bytes": disk["bytes"] if disk else None,
            "disk_hit_rate": disk["hit_rate"] if disk else None,
            "memory_bytes": snap["memory_bytes"],
            "load_progress": progress,
            "requests_finished": snap["requests_finished"],
            "stalled_s": snap["stalled_s"],
        }


async def run_status_publisher(engine: Engine, actions: Actions) -> None:
    """Publish this engine's status every STATUS_INTERVAL_S until cancelled."""
    layer = get_channel_layer()
    builder = StatusBuilder(engine, actions)
    failing = False
    while True:
        status = builder.build()
        try:
            await sync_to_async(control.status_publish)(status)
            if layer is not None:
                await layer.group_send(
                    control.DASHBOARD_GROUP, {"type": control.DASHBOARD_STATUS, "status": status}
                )
            failing = False
        except Exception:
            if not failing:  # say it once, not every second
                logger.warning("could not publish the engine status", exc_info=True)
            failing = True
        await asyncio.sleep(STATUS_INTERVAL_S)


def start_status_publisher(engine: Engine) -> None:
    """Publish the status from the engine's start until it stops."""
    lifecycle.spawn(run_status_publisher(engine, actions_for(engine)), name="engine-status")


lifecycle.on_start(start_status_publisher)
