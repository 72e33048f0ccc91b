"""Cross-process control (ADM-3): what the admin tells engines, and what engines report back.

The database is the desired state. Whatever process edits an alias (the admin, a management
command, a shell) announces it on the channel layer once the transaction commits; every engine
process listens (`models_app/catalogue/reconcile.py`), reconciles with the database and runs the requested action
through its writer path (LANE-4). Engines publish their live state to the cache and to the
dashboard's channel-layer group, so the admin and the dashboard show it from any process.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.cache import cache
from django.db import transaction

from models_app.catalogue import hotcache

logger = logging.getLogger(__name__)

# Channel-layer groups: engine processes listen on the first, dashboard sockets on the second.
ENGINE_GROUP = "mlxhost.engine"
DASHBOARD_GROUP = "mlxhost.dashboard"
# Message types (Channels dispatches "a.b" to a consumer's `a_b` method).
MODELS_CHANGED = "models.changed"
MODEL_ACTION = "models.action"
DASHBOARD_STATUS = "dashboard.status"
# A cancel that reached another host: the engine process running the response stops it.
RESPONSE_CANCEL = "responses.cancel"
# Sockets join a group per credential; this message closes them with 4401 (API-5).
CREDENTIALS_REVOKED = "credentials.revoked"

Action = Literal["load", "unload", "reload"]
ACTIONS: tuple[Action, ...] = ("load", "unload", "reload")

# Engine status in the cache: one entry per engine process, and an index of the live ones.
STATUS_KEY = "engine-status:{boot_id}"
STATUS_INDEX_KEY = "engine-status:index"
STATUS_TTL_S = 15  # an engine that stopped publishing drops out after this
# An instance's live state in words: the status publisher (`models_app.catalogue.live_status`) sends the
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

# Which actions make sense in each live state (ADM-7): the Models page and the model's admin page
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


async def cancel_everywhere(*, public_id: str, owner_id: int) -> None:
    """Ask every engine process to cancel `public_id` for `owner_id` (the one running it does)."""
    layer = get_channel_layer()
    if layer is None:
        return
    message = {"type": RESPONSE_CANCEL, "id": public_id, "owner_id": owner_id}
    try:
        await layer.group_send(ENGINE_GROUP, message)
    except Exception:
        logger.warning("could not send the cancel of %s to the engines", public_id, exc_info=True)


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


def request_action(
    *, model_name: str, action: Action, requested_by: str = "", host: int | None = None
) -> None:
    """Ask the engines, once this transaction commits, to load, unload or reload `model_name`.

    `host` names one fleet host (its MLXHOST_HOST_ID); None asks every engine. A reload of the
    whole fleet rolls (issue 15): the message carries the live hosts in order and an id, and each
    host starts only when the hosts before it have finished theirs (or stopped publishing), so the
    fleet never reloads everywhere at once.

    Raises:
        ValueError: `action` is not one of ACTIONS.
    """
    if action not in ACTIONS:
        raise ValueError(f"Unknown action {action!r}; expected one of {', '.join(ACTIONS)}.")
    message: dict[str, Any] = {
        "type": MODEL_ACTION,
        "model": model_name,
        "action": action,
        "by": requested_by,
    }
    if host is not None:
        message["host"] = host
    elif action == "reload":
        hosts = fleet_hosts()
        if len(hosts) > 1:
            message["rolling"] = {"id": uuid.uuid4().hex, "order": hosts}
    transaction.on_commit(lambda: _send(message))


def fleet_hosts(statuses: list[dict[str, Any]] | None = None) -> list[int]:
    """The host ids of the engines publishing now, in order (engines outside a fleet have none)."""
    found = statuses if statuses is not None else engine_statuses()
    return sorted({s["host_id"] for s in found if s.get("host_id") is not None})


def status_publish(payload: dict[str, Any]) -> None:
    """Store one engine process's status (called by that process, about once a second)."""
    boot_id = payload["boot_id"]
    cache.set(STATUS_KEY.format(boot_id=boot_id), payload, STATUS_TTL_S)
    now = time.time()
    redis = _redis_client()
    if redis is not None:
        # Several engines publish at once: one field each in a Redis hash, never a read-modify-write
        # of a shared value, which would drop another engine for a second (issue 15).
        redis.hset(cache.make_key(STATUS_INDEX_KEY), boot_id, now)
        return
    index: dict[str, float] = cache.get(STATUS_INDEX_KEY) or {}
    index = {key: at for key, at in index.items() if now - at < STATUS_TTL_S}
    index[boot_id] = now
    cache.set(STATUS_INDEX_KEY, index, None)


def _status_index() -> dict[str, float]:
    """Boot id -> when it last published, for the engines of the last STATUS_TTL_S seconds."""
    now = time.time()
    redis = _redis_client()
    if redis is None:
        index: dict[str, float] = cache.get(STATUS_INDEX_KEY) or {}
        return {key: at for key, at in index.items() if now - at < STATUS_TTL_S}
    key = cache.make_key(STATUS_INDEX_KEY)
    raw = redis.hgetall(key)
    found = {k.decode(): float(v) for k, v in raw.items()}
    stale = [boot_id for boot_id, at in found.items() if now - at >= STATUS_TTL_S]
    if stale:
        redis.hdel(key, *stale)
    return {boot_id: at for boot_id, at in found.items() if boot_id not in stale}


def _redis_client() -> Any:
    """The raw client of the Redis cache, or None when the cache is not Redis."""
    from django.core.cache import caches
    from django.core.cache.backends.redis import RedisCache

    backend = caches["default"]
    if not isinstance(backend, RedisCache):
        return None
    client: Any = backend  # its `_cache` (the RedisCacheClient) is not in the stubs
    return client._cache.get_client(write=True)


def engine_statuses() -> list[dict[str, Any]]:
    """The latest status of every engine process that published in the last STATUS_TTL_S seconds."""
    index = _status_index()
    keys = [STATUS_KEY.format(boot_id=boot_id) for boot_id in index]
    found = cache.get_many(keys) if keys else {}
    return sorted(found.values(), key=lambda status: status.get("started_at", 0))


# Counters that add up across the hosts holding an instance (a fleet's totals, issue 15).
SUMMED = (
    "active",
    "queued",
    "capacity",
    "tokens_per_s",
    "warm_sessions",
    "warm_bytes",
    "cache_tokens_saved",
    "memory_bytes",
    "requests_finished",
)
# Which host's state an instance shows when its hosts differ: the first that needs attention.
STATE_ORDER = ("error", "loading", "draining", "degraded", "resident", "unloaded")


def host_name(status: dict[str, Any]) -> str:
    """How pages name an engine process: `h01`.. on a fleet host, else hostname and pid."""
    host_id = status.get("host_id")
    return f"h{host_id:02d}" if host_id is not None else f"{status.get('host', '?')}:{status.get('pid', '?')}"


def instance_views(statuses: list[dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Instance id -> its live view (state, counters, progress), across engine processes.

    An instance held by several hosts (a fleet) gets their totals (SUMMED), the state that needs
    attention first (STATE_ORDER) with a label naming each host's, and `hosts`: one view per host,
    so a page never shows one host's numbers as the model's.
    """
    per_instance: dict[int, list[dict[str, Any]]] = {}
    for status in engine_statuses() if statuses is None else statuses:
        for view in status.get("instances", []):
            per_instance.setdefault(view["instance_id"], []).append({**view, "host": host_name(status)})
    return {instance_id: _merged(views) for instance_id, views in per_instance.items()}


FLEET_COUNTERS = ("active", "queued", "capacity", "memory_bytes", "warm_sessions", "tokens_per_s")


def fleet_view(statuses: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every engine reporting now, with its models and lanes, and the fleet's total (issue 15):
    `{"hosts": [{"host", "host_id", "models": [...], **counters}], "total": counters}`."""
    hosts = []
    for status in engine_statuses() if statuses is None else statuses:
        views = status.get("instances", [])
        models = [
            {
                "instance_id": v["instance_id"],
                "aliases": v.get("aliases", []),
                "state": v.get("live_state"),
                **{key: v.get(key) or 0 for key in FLEET_COUNTERS},
            }
            for v in views
        ]
        counters = {key: sum(m[key] for m in models) for key in FLEET_COUNTERS}
        hosts.append(
            {"host": host_name(status), "host_id": status.get("host_id"), "models": models, **counters}
        )
    total = {key: sum(h[key] for h in hosts) for key in FLEET_COUNTERS}
    return {"hosts": sorted(hosts, key=lambda h: h["host"]), "total": total}


def _merged(views: list[dict[str, Any]]) -> dict[str, Any]:
    if len(views) == 1:
        return {**views[0], "hosts": views}
    views = sorted(views, key=lambda v: v["host"])
    rank = {state: i for i, state in enumerate(STATE_ORDER)}
    first = min(views, key=lambda v: rank.get(str(v.get("live_state")), len(STATE_ORDER)))
    merged = {**first, "hosts": views, "aliases": sorted({a for v in views for a in v.get("aliases", [])})}
    for key in SUMMED:
        merged[key] = sum(v.get(key) or 0 for v in views)
    for key in ("disk_entries", "disk_bytes"):  # None: the disk tier is off on every host
        known = [v[key] for v in views if v.get(key) is not None]
        merged[key] = sum(known) if known else None
    lookups = [(v.get("cache_hit_rate"), v.get("requests_finished") or 0) for v in views]
    weighted = [(rate, n) for rate, n in lookups if rate is not None]
    total = sum(n for _, n in weighted)
    merged["cache_hit_rate"] = (
        sum(rate * n for rate, n in weighted) / total if total else (weighted[0][0] if weighted else None)
    )
    if len({v.get("label") for v in views}) > 1:
        merged["label"] = "; ".join(f"{v['label']} on {v['host']}" for v in views)
    return merged


def action_views(statuses: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Model name -> the last admin action an engine ran for it (action, ok, error, at)."""
    actions: dict[str, dict[str, Any]] = {}
    for status in engine_statuses() if statuses is None else statuses:
        for name, result in status.get("actions", {}).items():
            if name not in actions or result.get("at", 0) > actions[name].get("at", 0):
                actions[name] = result
    return actions
