"""Staff pages outside the admin: the live dashboard (ADM-2), the chat page (ADM-4) and the live
Models page with its load / unload / reload buttons (ADM-7, OPS-4)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseNotAllowed
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods, require_safe

from mlxhost.wire import json_response
from models_app.catalogue import control, selectors, services
from models_app.console import live_state, status_history
from models_app.turns import transcripts

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse

    from models_app.models import Model

View = Callable[..., "HttpResponse"]

CHANGE_MODEL = "models_app.change_model"
ACTION_LABELS = {"load": "Load", "unload": "Unload\u2026", "reload": "Reload"}
ACTION_REQUESTED = "{action} requested for {model}."
SESSION_ENDED = "Your session has ended: log in again to act."


def staff_only(view: View) -> View:
    """Anonymous visitors go to the admin login; a signed-in user who is not staff gets a 403
    (sending them to the login page again would only loop)."""
    guarded = staff_member_required(view)

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated and not request.user.is_staff:
            raise PermissionDenied
        if not request.user.is_authenticated and "application/json" in request.headers.get("Accept", ""):
            # A page's script, left open after a logout: a login page's HTML would read as success.
            return json_response({"message": SESSION_ENDED, "code": "session_ended"}, status=401)
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
    """The live instance table, its charts and load progress (ADM-2, OPS-4).

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
        "chat_aliases": [alias for alias in aliases if alias.model.kind in alias.model.GENERATING_KINDS],
        "statuses": statuses,
        # The charts' last hour, so a dashboard opened after an incident shows it (ADM-2).
        "history": status_history.history_of(boot_ids=[status["boot_id"] for status in statuses]),
        "rows": instance_rows(statuses),
        "actions": control.action_views(statuses),
        "no_instance_label": control.LIVE_LABELS["unloaded"],
    }
    return _hardened(request, render(request, "dashboard/index.html", context))


@require_safe
@staff_only
def models_page(request: HttpRequest) -> HttpResponse:
    """Every model and its aliases, live, with the actions that fit each one's state (ADM-7, OPS-4).

    The first paint comes from the engines' last published status; the page's script then
    follows `/ws/dashboard` and re-renders each row from every pushed status, without a reload.
    """
    statuses = control.engine_statuses()
    views = control.instance_views(statuses) if statuses else None
    actions = control.action_views(statuses)
    can_act = request.user.has_perm(CHANGE_MODEL)
    rows = [
        model_row(
            model, live_state.model_live_state(model=model, views=views, actions=actions), can_act=can_act
        )
        for model in selectors.models_with_aliases()
    ]
    context = {
        **admin.site.each_context(request),
        "title": "Models",
        "is_nav_sidebar_enabled": False,
        "rows": rows,
        "statuses": statuses,
        "models_data": [row["data"] for row in rows],
        "page_data": {
            "actions_by_state": control.ACTIONS_BY_STATE,
            "labels": {"unreported": control.NO_ENGINE_LABEL, **control.LIVE_LABELS},
            "can_act": can_act,
        },
    }
    return _hardened(request, render(request, "dashboard/models.html", context))


@require_http_methods(["GET", "POST"])
@staff_only
def model_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    """POST: ask the engines to load, unload or reload the model (ADM-1, ADM-7); back to `next`.

    An unload is confirmed first: a GET, or a POST without `confirmed`, answers a page naming
    every alias it takes down. A script that asks for JSON gets 202 and the message instead.
    """
    if action not in control.ACTIONS:
        raise Http404("No such action.")
    model = get_object_or_404(selectors.models_with_aliases(), pk=pk)
    if not request.user.has_perm(CHANGE_MODEL):
        raise PermissionDenied
    back = _next_url(request)
    host = _fleet_host(request)
    if action == "unload" and not request.POST.get("confirmed"):
        return _hardened(request, unload_confirmation(request, model, back, host))
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    services.model_request_action(model=model, action=action, actor=request.user, host=host)
    where = f" on h{host:02d}" if host is not None else ""
    message = ACTION_REQUESTED.format(action=action.capitalize(), model=model.name + where)
    if "application/json" in request.headers.get("Accept", ""):
        return json_response({"message": message, "model": model.name, "action": action}, status=202)
    messages.success(request, message)
    return redirect(back)


def _fleet_host(request: HttpRequest) -> int | None:
    """The fleet host an action names (`host`, one of the hosts reporting now), None for all.

    Raises:
        Http404: the host is not a number or no such host reports.
    """
    raw = request.POST.get("host") or request.GET.get("host") or ""
    if not raw:
        return None
    if not raw.isdigit() or int(raw) not in control.fleet_hosts():
        raise Http404("No such fleet host is running.")
    return int(raw)


def unload_confirmation(
    request: HttpRequest, model: Model, back: str, host: int | None = None
) -> HttpResponse:
    context = {
        "host": host,
        **admin.site.each_context(request),
        "title": f"Unload {model.name}?",
        "is_nav_sidebar_enabled": False,
        "model": model,
        "serving": serving_names(model),
        "next": back,
        "action_url": reverse("dashboard:model-action", args=(model.pk, "unload")),
    }
    return render(request, "dashboard/unload_confirm.html", context)


def serving_names(model: Model) -> list[str]:
    """The aliases an unload takes down: the model's enabled ones (they share its instance)."""
    return [alias.name for alias in model.aliases.all() if alias.enabled]


def model_row(model: Model, live: live_state.AliasLiveState, *, can_act: bool) -> dict[str, Any]:
    """One model as the Models page renders it, and the facts its script needs to follow it."""
    aliases = list(model.aliases.all())
    serving = serving_names(model)
    buttons = [
        {
            "name": action,
            "label": ACTION_LABELS[action],
            "url": reverse("dashboard:model-action", args=(model.pk, action)),
            "enabled": action in live.allowed_actions,
        }
        for action in control.ACTIONS
    ]
    return {
        "model": model,
        "live": live,
        "aliases": aliases,
        "serving": serving,
        "admin_url": reverse("admin:models_app_model_change", args=(model.pk,)),
        "buttons": buttons if can_act else [],
        "data": {
            "id": model.pk,
            "name": model.name,
            "instance_id": model.instance_id,
            "aliases": [alias.name for alias in aliases],
            "serving": serving,
        },
    }


def _next_url(request: HttpRequest) -> str:
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    safe = url_has_allowed_host_and_scheme(
        wanted, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
    return wanted if wanted and safe else reverse("dashboard:models")


def _hardened(request: HttpRequest, response: HttpResponse) -> HttpResponse:
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
        "aliases": list(selectors.aliases_for_chat()),
        "history": history,
        "missing_id": public_id if public_id and history is None else "",
        "recent": transcripts.conversations_recent(owner_id=owner_id),
        "current_root": history["root"] if history else "",
    }
    response = render(request, "chat/index.html", context, status=404 if context["missing_id"] else 200)
    response["Content-Security-Policy"] = content_security_policy(request)
    response["Referrer-Policy"] = "same-origin"
    return response


@require_safe
@staff_only
def chat_aliases(request: HttpRequest) -> HttpResponse:
    """The chat page's model list, as JSON: it re-reads it to stay live (ADM-4)."""
    aliases = [
        {
            "name": alias.name,
            "temperature": alias.temperature,
            "top_p": alias.top_p,
            "max_output_tokens": alias.max_tokens,
        }
        for alias in selectors.aliases_for_chat()
    ]
    return json_response({"aliases": aliases})


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
            # The last request's first-token time means nothing once the weights are gone.
            "ttft_live": bool(view.get("ttft_ms")) and view.get("live_state") in control.RESIDENT_STATES,
        }
        for status in statuses
        for view in status.get("instances", [])
    ]


def _percent(rate: object) -> int | None:
    return round(100 * rate) if isinstance(rate, int | float) else None
