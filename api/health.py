"""Health probes: /healthz (process up, public, minimal) and /readyz (per-model and per-instance state)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from api.auth import api_endpoint, may_see_internals
from mlxhost.runtime import engine_if_started
from mlxhost.wire import json_response
from models_app.catalogue import control, selectors
from models_app.catalogue.live_status import instance_status

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse

# A model in one of these states can take a request now: `unloaded` loads on it (OPS-3), and
# during an in-place reload requests wait in its lane for the new load (LANE-4): a host must not
# leave its balancer then, which would cut the requests waiting there.
SERVING_STATES = frozenset({"ok", "degraded", "unloaded", "reloading"})
# Every model in one of these: nothing to report.
HEALTHY_STATES = frozenset({"ok", "unloaded"})


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up and serving HTTP."""
    return json_response({"status": "ok"})


def _served_models() -> list[dict[str, Any]]:
    """The models clients can name (an enabled alias), with their aliases and instance id."""
    served = []
    for model in selectors.models_served():
        aliases = sorted(alias.name for alias in model.aliases.all() if alias.enabled)
        if aliases:
            served.append({"model": model.name, "aliases": aliases, "instance_id": model.instance_id})
    return served


def _aliases_by_instance() -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for alias in selectors.aliases_enabled():
        assert alias.instance_id is not None  # aliases_enabled() filters on the model's instance
        names.setdefault(alias.instance_id, []).append(alias.name)
    return names


def model_states(models: list[dict[str, Any]], statuses: dict[int, str]) -> list[dict[str, Any]]:
    """Each served model with the OPS-2 state of its instance here (`unloaded` when this engine
    does not hold it)."""
    return [{**model, "state": statuses.get(model["instance_id"], "unloaded")} for model in models]


def readiness(models: list[dict[str, Any]], *, started: bool) -> tuple[bool, str]:
    """(ready, status word): ready while at least one model can serve, or there is none to load,
    so one failed or loading model never takes a healthy host out of its load balancer (OPS-2)."""
    if not started:
        return False, "starting"
    states = {model["state"] for model in models}
    if models and not states & SERVING_STATES:
        return False, "unavailable"
    return True, "ok" if states <= HEALTHY_STATES else "degraded"


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def readyz(request: HttpRequest) -> HttpResponse:
    """200 while the host can serve at least one of its models (or has none), else 503.

    Load balancers probe it without credentials and get the status and how many models are in
    each state; an API key or a staff login also gets each model's state and the instances'
    counters (LANE-9: active, queued, permits, capacity, limit, saturated).
    """
    engine = engine_if_started()
    snapshots: list[dict[str, Any]] = engine.snapshot() if engine else []  # on the loop: it owns them
    instances = [{**snap, "status": instance_status(snap)} for snap in snapshots]
    models = model_states(
        await sync_to_async(_served_models)(),
        {i["instance_id"]: "reloading" if i.get("reloading") else i["status"] for i in instances},
    )
    ready, status = readiness(models, started=engine is not None)
    body: dict[str, Any] = {"status": status, "states": dict(Counter(m["state"] for m in models))}
    if await may_see_internals(request):
        names = await sync_to_async(_aliases_by_instance)()
        for item in instances:
            # Names bound in this engine (routing truth here) plus the database's view.
            bound = [name for name in item["aliases"] if not name.startswith("instance:")]
            item["aliases"] = sorted({*bound, *names.get(item["instance_id"], [])})
        body["models"] = models
        body["instances"] = instances
        # Every engine of the fleet as it last reported (this one included), and their total.
        body["fleet"] = await sync_to_async(control.fleet_view)()
    return json_response(body, status=200 if ready else 503)
