"""Health probes: /healthz (process up, public, minimal) and /readyz (per-instance state)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api.auth import api_endpoint, may_see_internals
from mlxhost.runtime import engine_if_started
from mlxhost.runtime.status import instance_status
from models_app import selectors


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up and serving HTTP."""
    return JsonResponse({"status": "ok"})


def _aliases_by_instance() -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for alias in selectors.aliases_enabled():
        assert alias.instance_id is not None  # aliases_enabled() filters on the model's instance
        names.setdefault(alias.instance_id, []).append(alias.name)
    return names


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def readyz(request: HttpRequest) -> HttpResponse:
    """Ready when no instance is loading or failed; per-instance detail for API keys and staff.

    Load balancers probe it without credentials and get the status alone; the counters
    (LANE-9: active, queued, permits, capacity, limit, saturated) need a key or a staff login.
    """
    engine = engine_if_started()
    snapshots: list[dict[str, Any]] = engine.snapshot() if engine else []
    instances = [{**snap, "status": instance_status(snap)} for snap in snapshots]
    ready = engine is not None and all(i["status"] in ("ok", "unloaded", "degraded") for i in instances)
    degraded = any(i["status"] == "degraded" for i in instances)
    status = "starting" if engine is None else "ok" if ready and not degraded else "degraded"
    body: dict[str, Any] = {"status": status}
    if await may_see_internals(request):
        names = await sync_to_async(_aliases_by_instance)()
        for item in instances:
            # Names bound in this engine (routing truth here) plus the database's view.
            bound = [name for name in item["aliases"] if not name.startswith("instance:")]
            item["aliases"] = sorted({*bound, *names.get(item["instance_id"], [])})
        body["instances"] = instances
    return JsonResponse(body, status=200 if ready else 503)
