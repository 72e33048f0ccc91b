"""The live status (ADM-2, OPS-2, OPS-4): each instance's state and label, published once a second.

The one place that names an instance's state. `instance_status` is OPS-2's health ladder (the
/readyz probe uses it); `instance_live_state` is the state the admin and the dashboard show,
published with its words (`models_app.catalogue.control.LIVE_LABELS`) so that the admin, the dashboard
view and `dashboard.js` only render `view["label"]`. `run_status_publisher` reports every
instance to the cache (the admin reads it) and to the dashboard group (pushed to the browsers).
Installed by `mlxhost.composition`: the publisher runs from the engine's start until it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from mlxhost.runtime import lifecycle
from models_app.catalogue import control
from models_app.catalogue.reconcile import Actions, actions_for, is_alias
from models_app.console import status_history

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


def duration_words(seconds: float) -> str:
    """`seconds` the way the pages say it: "45 s", "4 min 10 s", "2 h 5 min"."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    if minutes:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    return f"{secs} s"


def idle_unload_fields(
    *, live_state: str, pinned: bool, keep_alive_s: float | None, idle_s: float, busy: bool
) -> dict[str, Any]:
    """When the keep-alive frees this instance's memory (OPS-3): `unload_in_s`, the seconds left
    if no request comes (None when nothing counts down), and `unload_label`, in words."""
    if pinned:
        return {"unload_in_s": None, "unload_label": "never (pinned)"}
    if keep_alive_s is None:
        return {"unload_in_s": None, "unload_label": "never (no keep-alive)"}
    if live_state not in control.RESIDENT_STATES:
        return {"unload_in_s": None, "unload_label": "\u2014"}
    if busy:  # the idle clock starts when the last request leaves
        return {"unload_in_s": None, "unload_label": f"{duration_words(keep_alive_s)} after the last request"}
    left = max(0.0, keep_alive_s - idle_s)
    return {"unload_in_s": round(left), "unload_label": f"in {duration_words(left)}"}


class StatusBuilder:
    """Turns engine snapshots into the status the admin and dashboard show, with rates over time."""

    def __init__(self, engine: Engine, actions: Actions, *, min_rate_window_s: float = 0.0) -> None:
        self.engine = engine
        self.actions = actions
        # A report sooner than this after the last one (pushed early: an action started or
        # ended) repeats the last rate instead of measuring over a sliver of time.
        self.min_rate_window_s = min_rate_window_s
        self._last: dict[int, tuple[int, float, float]] = {}  # instance id -> (tokens, when, rate)

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
        instance_id = snap["instance_id"]
        # Tokens/s: generated by a chat model, read by an embedding model (API-14).
        tokens = snap["tokens_generated"] + snap.get("embeddings", {}).get("tokens", 0)
        lane, progress = snap["lane"], snap["load_progress"]
        cache, disk = snap["prefix_cache"]["memory"], snap["prefix_cache"].get("disk")
        status = instance_status(snap)
        live = live_fields(state=snap["state"], status=status, draining=lane["draining"])
        return {
            "instance_id": instance_id,
            "kind": snap.get("kind", "chat"),
            "aliases": [name for name in snap["aliases"] if is_alias(name)],
            "state": snap["state"],
            "status": status,
            **live,
            **idle_unload_fields(
                live_state=live["live_state"],
                pinned=bool(snap.get("pinned")),
                keep_alive_s=snap.get("keep_alive_s"),
                idle_s=float(snap.get("idle_s") or 0.0),
                busy=bool(lane["active"] or lane["queued"]),
            ),
            "pinned": bool(snap.get("pinned")),
            "keep_alive_s": snap.get("keep_alive_s"),
            "idle_s": snap.get("idle_s"),
            "error": snap["last_error"] or "",
            "active": lane["active"],
            "queued": lane["queued"],
            "capacity": lane["capacity"],
            # A model that cannot batch serves one at a time whatever its concurrency (LANE-1).
            "can_batch": snap.get("can_batch"),
            "configured_capacity": snap.get("configured_capacity"),
            "draining": lane["draining"],
            "tokens_per_s": self._rate(instance_id, tokens, now),
            "decode_tps": snap["decode_tps"],
            # The last finished request's time to first token counts from when it entered the
            # lane, so it includes its queue wait; `queue_ms` is that wait.
            "ttft_ms": snap["ttft_ms"],
            "queue_ms": snap.get("queue_ms", 0.0),
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
            # Speculative decoding (docs/speculation.md): tokens drafted and accepted, accepted /
            # drafted, and tokens per pass (None before any row that could draft ended).
            "speculation_drafted": (snap.get("speculation") or {}).get("drafted"),
            "speculation_accepted": (snap.get("speculation") or {}).get("accepted"),
            "speculation_acceptance": (snap.get("speculation") or {}).get("acceptance"),
            "tokens_per_pass": (snap.get("speculation") or {}).get("tokens_per_pass"),
        }

    def _rate(self, instance_id: int, tokens: int, now: float) -> float:
        last_tokens, last_at, rate = self._last.get(instance_id, (tokens, now, 0.0))
        elapsed = now - last_at
        if instance_id in self._last and elapsed < self.min_rate_window_s:
            return rate
        rate = round((tokens - last_tokens) / elapsed, 1) if elapsed > 0 else 0.0
        self._last[instance_id] = (tokens, now, rate)
        return rate


async def run_status_publisher(engine: Engine, actions: Actions) -> None:
    """Publish this engine's status every STATUS_INTERVAL_S until cancelled."""
    layer = get_channel_layer()
    builder = StatusBuilder(engine, actions, min_rate_window_s=STATUS_INTERVAL_S / 2)
    failing = False
    while True:
        status = builder.build()
        try:
            await sync_to_async(_publish)(status)
            if layer is not None:
                await layer.group_send(
                    control.DASHBOARD_GROUP, {"type": control.DASHBOARD_STATUS, "status": status}
                )
            failing = False
        except Exception:
            if not failing:  # say it once, not every second
                logger.warning("could not publish the engine status", exc_info=True)
            failing = True
        await _next_report(actions)


def _publish(status: dict[str, Any]) -> None:
    control.status_publish(status)
    status_history.history_record(status)  # the charts' last hour (ADM-2)


async def _next_report(actions: Actions) -> None:
    """Wait a report's interval, or less when an admin action starts or ends: the pages show
    an unload within a moment, not at the next tick."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(actions.changed.wait(), STATUS_INTERVAL_S)
    actions.changed.clear()


def start_status_publisher(engine: Engine) -> None:
    """Publish the status from the engine's start until it stops."""
    lifecycle.spawn(run_status_publisher(engine, actions_for(engine)), name="engine-status")
