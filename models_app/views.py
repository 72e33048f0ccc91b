"""Staff pages outside the admin: the live dashboard and its playground, and the chat page (ADM-2,
ADM-4, OPS-4)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from django.views.decorators.http import require_safe

from models_app import control, selectors, transcripts

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
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "is_nav_sidebar_enabled": False,
        "aliases": list(selectors.aliases_enabled()),
        "statuses": statuses,
        "rows": instance_rows(statuses),
        "actions": control.action_views(statuses),
        "no_instance_label": control.LIVE_LABELS["unloaded"],
    }
    response = render(request, "dashboard/index.html", context)
    response["Content-Security-Policy"] = content_security_policy(request)
    response["Referrer-Policy"] = "same-origin"
    return response


@require_safe
@staff_only
def chat(request: HttpRequest) -> HttpResponse:
    """A chat with any enabled alias over /ws/v1/responses (ADM-4).

    The server holds the conversation: each turn continues the last by `previous_response_id`, and
    `?response=<id>` reopens one of this user's stored conversations (another's is a 404, PER-6).
    """
    owner_id = request.user.pk
    assert owner_id is not None, "staff_only let a signed-in user through"
    public_id = request.GET.get("response", "")
    history = transcripts.chat_history(owner_id=owner_id, public_id=public_id) if public_id else None
    context = {
        **admin.site.each_context(request),
        "title": "Chat",
        "is_nav_sidebar_enabled": False,
        "aliases": list(selectors.aliases_enabled()),
        "history": history,
        "missing_id": public_id if public_id and history is None else "",
        "recent": transcripts.conversations_recent(owner_id=owner_id),
        "current_id": history["id"] if history else "",
    }
    response = render(request, "chat/index.html", context, status=404 if context["missing_id"] else 200)
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
