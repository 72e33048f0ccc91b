"""Staff pages outside the admin: the live dashboard and its playground (ADM-2, OPS-4)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from django.views.decorators.http import require_safe

from models_app import control, selectors

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse

View = Callable[..., "HttpResponse"]


def staff_only(view: View) -> View:
    """Anonymous visitors go to the admin login; a signed-in user who is not staff gets a 403
    (sending them to the login page again would only loop)."""
    guarded = staff_member_required(view)

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated and not request.user.is_staff:
            raise PermissionDenied
        return guarded(request, *args, **kwargs)

    return wrapper


def content_security_policy(request: HttpRequest) -> str:
    """Scripts, styles and sockets from this site only; no inline code, no framing (API-5)."""
    host = request.get_host()  # validated against ALLOWED_HOSTS
    # Older Chromium does not count ws: as 'self', so the socket origins are named as well.
    return "; ".join(
        [
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self' data:",
            f"connect-src 'self' ws://{host} wss://{host}",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


@require_safe
@staff_only
def dashboard(request: HttpRequest) -> HttpResponse:
    """The live instance table, charts and load progress, plus the playground (ADM-2, OPS-4).

    The first paint comes from the engines' last published status (the cache); the page's
    script then follows `/ws/dashboard`, which pushes a status frame per engine every second.
    """
    statuses = control.engine_statuses()
    aliases = list(selectors.aliases_enabled())
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "is_nav_sidebar_enabled": False,
        "aliases": aliases,
        # The playground chats: embedding models (API-13) are listed above, not offered there.
        "chat_aliases": [alias for alias in aliases if alias.model.kind == alias.model.Kind.CHAT],
        "statuses": statuses,
        "rows": instance_rows(statuses),
        "actions": control.action_views(statuses),
        "no_instance_label": control.LIVE_LABELS["unloaded"],
    }
    response = render(request, "dashboard/index.html", context)
    response["Content-Security-Policy"] = content_security_policy(request)
    response["Referrer-Policy"] = "same-origin"
    return response


def load_percent(progress: dict[str, Any]) -> int:
    total = progress.get("total") or 0
    return max(0, min(100, round(100 * (progress.get("done") or 0) / total))) if total else 0


def instance_rows(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every engine's instances as table rows, keyed like the page's script keys them."""
    return [
        {
            **view,
            "key": f"{status['boot_id']}:{view['instance_id']}",
            "engine": f"{status.get('host', '?')} · pid {status.get('pid', '?')}",
            "label": view.get("label") or control.LIVE_LABELS["unloaded"],  # as the engine published it
            "load_percent": load_percent(view.get("load_progress") or {}),
            "cache_hit_percent": _percent(view.get("cache_hit_rate")),
        }
        for status in statuses
        for view in status.get("instances", [])
    ]


def _percent(rate: object) -> int | None:
    return round(100 * rate) if isinstance(rate, int | float) else None
