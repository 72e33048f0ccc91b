"""Health probes: /healthz (process up, public, minimal) and /readyz (per-instance state)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api.auth import api_endpoint
from api.engine_client import engine_if_started
from models_app import selectors


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def healthz(request: HttpRequest) -> HttpResponse:
    """The process is up and serving HTTP."""
    return JsonResponse({"status": "ok"})


def _aliases_by_instance() -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for alias in selectors.aliases_enabled():
        names.setdefault(alias.instance_id, []).append(alias.name)
    return names


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def readyz(request: HttpRequest) -> HttpResponse:
    """Per-instance state; 503 while any pinned instance is loading or failed to load."""
    engine = engine_if_started()
    snapshots: list[dict[str, Any]] = engine.snapshot() if engine else []
    names = await sync_to_async(_aliases_by_instance)()
    instances = []
    for snap in snapshots:
        state = snap["state"]
        status = {"ready": "ok", "loading": "loading", "error": "error"}.get(state, "unloaded")
        if state == "ready" and not snap["worker_alive"]:
            status = "degraded"
        instances.append({"aliases": names.get(snap["instance_id"], []), "status": status, **snap})
    ready = engine is not None and all(i["status"] in ("ok", "unloaded") for i in instances)
    body = {"status": "ok" if ready else "starting" if engine is None else "degraded", "instances": instances}
    return JsonResponse(body, status=200 if ready else 503)
