"""Cross-process control (ADM-3): what the admin tells engines, and what engines report back.

The database is the desired state. Whatever process edits an alias (the admin, a management
command, a shell) announces it on the channel layer once the transaction commits; every engine
process listens (`mlxhost/runtime/control.py`), reconciles with the database and runs the requested action
through its writer path (LANE-4). Engines publish their live state to the cache and to the
dashboard's channel-layer group, so the admin and the dashboard show it from any process.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.cache import cache
from django.db import transaction

from models_app import hotcache

logger = logging.getLogger(__name__)

# Channel-layer groups: engine processes listen on the first, dashboard sockets on the second.
ENGINE_GROUP = "mlxhost.engine"
DASHBOARD_GROUP = "mlxhost.dashboard"
# Message types (Channels dispatches "a.b" to a consumer's `a_b` method).
MODELS_CHANGED = "models.changed"
MODEL_ACTION = "models.action"
DASHBOARD_STATUS = "dashboard.status"
# Sockets join a group per credential; this message closes them with 4401 (API-5).
CREDENTIALS_REVOKED = "credentials.revoked"

Action = Literal["load", "unload", "reload"]
ACTIONS: tuple[Action, ...] = ("load", "unload", "reload")

# Engine status in the cache: one entry per engine process, and an index of the live ones.
STATUS_KEY = "engine-status:{boot_id}"
STATUS_INDEX_KEY = "engine-status:index"
STATUS_TTL_S = 15  # an engine that stopped publishing drops out after this
# An instance's live state in words: the status publisher (`mlxhost.runtime.status`) sends the
# label with each instance, so the admin, the dashboard and its script only render it (ADM-2).
LIVE_LABELS = {
    "unloaded": "not loaded",
    "loading": "loading",
    "resident": "resident",
    "degraded": "resident (degraded)",
    "draining": "draining",
    "error": "error",
}


# What the pages say of a model while no engine process publishes status.
NO_ENGINE_LABEL = "no engine process reporting"
# The live states in which the weights are in memory and serving.
RESIDENT_STATES = ("resident", "degraded")

# Which actions make sense in each live state (ADM-4): the Models page and the model's admin page
# offer these and disable the rest. Nothing while no engine reports (no one would run it), while
# weights load or drain, or while an earlier action on the model still runs.
ACTIONS_BY_STATE: dict[str, tuple[Action, ...]] = {
    "unreported": (),
    "unloaded": ("load",),
    "loading": (),
    "resident": ("unload", "reload"),
    "degraded": ("unload", "reload"),
    "draining": (),
    "error": ("load", "reload"),
}


def _send(message: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(ENGINE_GROUP, message)
    except Exception:  # the layer is down: engines still reconcile on start and on the next message
        logger.warning("could not notify engines of %s", message["type"], exc_info=True)


def apikey_group(key_id: int) -> str:
    """The channel-layer group of the sockets an API key opened."""
    return f"mlxhost.apikey.{key_id}"


def session_group(session_key: str) -> str:
    """The channel-layer group of the sockets a Django session opened (its key is alphanumeric)."""
    return f"mlxhost.session.{session_key}"


def sockets_close_rollback_unsafe(*, group: str) -> None:
    """Close the open sockets of `group` (every process) with 4401, now, not on commit."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": CREDENTIALS_REVOKED})
    except Exception:  # the layer is down: each socket's periodic re-check still closes it
        logger.warning("could not close the sockets of a revoked credential", exc_info=True)


def sockets_close_on_commit(*, group: str) -> None:
    """Close the open sockets of `group` with 4401 once this transaction commits (API-5)."""
    transaction.on_commit(lambda: sockets_close_rollback_unsafe(group=group))


def session_sockets_close(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    """`user_logged_out` receiver: the sockets this session opened close with 4401 (API-5)."""
    session_key = getattr(getattr(request, "session", None), "session_key", None)
    if session_key:
        sockets_close_on_commit(group=session_group(session_key))


def notify_models_changed() -> None:
    """Tell every engine, once this transaction commits, that aliases changed (reconcile); this
    process's cached alias lookups are dropped at the same moment."""
    transaction.on_commit(hotcache.aliases.clear)
    transaction.on_commit(lambda: _send({"type": MODELS_CHANGED}))


def request_action(*, model_name: str, action: Action, requested_by: str = "") -> None:
    """Ask every engine, once this transaction commits, to load, unload or reload `model_name`.

    Raises:
        ValueError: `action` is not one of ACTIONS.
    """
    if action not in ACTIONS:
        raise ValueError(f"Unknown action {action!r}; expected one of {', '.join(ACTIONS)}.")
    message = {"type": MODEL_ACTION, "model": model_name, "action": action, "by": requested_by}
    transaction.on_commit(lambda: _send(message))


def status_publish(payload: dict[str, Any]) -> None:
    """Store one engine process's status (called by that process, about once a second)."""
    boot_id = payload["boot_id"]
    cache.set(STATUS_KEY.format(boot_id=boot_id), payload, STATUS_TTL_S)
    index: dict[str, float] = cache.get(STATUS_INDEX_KEY) or {}
    now = time.time()
    index = {key: at for key, at in index.items() if now - at < STATUS_TTL_S}
    index[boot_id] = now
    cache.set(STATUS_INDEX_KEY, index, None)


def engine_statuses() -> list[dict[str, Any]]:
    """The latest status of every engine process that published in the last STATUS_TTL_S seconds."""
    index: dict[str, float] = cache.get(STATUS_INDEX_KEY) or {}
    keys = [STATUS_KEY.format(boot_id=boot_id) for boot_id in index]
    found = cache.get_many(keys) if keys else {}
    return sorted(found.values(), key=lambda status: status.get("started_at", 0))


def instance_views(statuses: list[dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Instance id -> its live view (state, counters, progress), across engine processes."""
    views: dict[int, dict[str, Any]] = {}
    for status in engine_statuses() if statuses is None else statuses:
        for view in status.get("instances", []):
            views[view["instance_id"]] = view
    return views


def action_views(statuses: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Model name -> the last admin action an engine ran for it (action, ok, error, at)."""
    actions: dict[str, dict[str, Any]] = {}
    for status in engine_statuses() if statuses is None else statuses:
        for name, result in status.get("actions", {}).items():
            if name not in actions or result.get("at", 0) > actions[name].get("at", 0):
                actions[name] = result
    return actions
