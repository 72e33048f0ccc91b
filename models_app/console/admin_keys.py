"""Admin pages for API keys and their usage: a new key's secret shown once with ready-to-paste
snippets, revoking, limits and last use (KEY-1, KEY-4); usage by day per key and per user, with a
chart and a CSV export (KEY-3). Writes go through services; sums come from `models_app.accounting.usage`."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import F, Q, Sum
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, StreamingHttpResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from models_app.accounting import usage
from models_app.accounting.snippets import MODEL_PLACEHOLDER, env_snippet, key_snippets
from models_app.catalogue import selectors, services
from models_app.console import words
from models_app.console.forms import API_KEY_CREATE_FIELDS, ApiKeyChangeForm, ApiKeyCreateForm
from models_app.models import ApiKey, Model, UsageDay

if TYPE_CHECKING:
    from django import forms
    from django.contrib.admin.options import _FieldGroups
    from django.db.models import QuerySet
    from django.http import HttpResponseRedirect
    from django.utils.safestring import SafeString

    _ApiKeyAdminBase = admin.ModelAdmin[ApiKey]
    _UsageDayAdminBase = admin.ModelAdmin[UsageDay]
else:
    _ApiKeyAdminBase = _UsageDayAdminBase = admin.ModelAdmin

DASH = "—"
RECENT_DAYS = 30
NEW_KEY_SESSION = "mlxhost-new-key-{pk}"  # the raw key, until the page that shows it once
REVOKED = "Revoked {names}: requests with {it} now get 401, and {its} open WebSockets are closed."
NOTHING_REVOKED = "The selected keys were revoked already."
USAGE_MEDIA_JS = ("vendor/uplot/uPlot.iife.min.js", "mlxhost/usage.js")
USAGE_MEDIA_CSS = ("vendor/uplot/uPlot.min.css", "mlxhost/keys.css")


# Shared pieces ---------------------------------------------------------------------------------------


def status_badge(key: ApiKey) -> SafeString:
    if key.revoked_at is not None:
        return format_html(
            '<span class="mlxhost-badge mlxhost-badge-revoked" title="revoked {}">revoked</span>',
            timezone.localtime(key.revoked_at).strftime("%Y-%m-%d %H:%M"),
        )
    return format_html('<span class="mlxhost-badge mlxhost-badge-{}">{}</span>', "active", "active")


def last_used_html(key: ApiKey) -> SafeString | str:
    if key.last_used_at is None:
        return "never"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        key.last_used_at.isoformat(),
        timezone.localtime(key.last_used_at).strftime("%Y-%m-%d %H:%M"),
        words.relative_time(key.last_used_at),
    )


def limits_html(key: ApiKey) -> SafeString | str:
    parts = []
    if key.requests_per_minute:
        parts.append((f"{key.requests_per_minute:,} requests/min",))
    if key.tokens_per_day:
        parts.append((f"{key.tokens_per_day:,} tokens/day",))
    return format_html_join("", '<span class="mlxhost-limit">{}</span>', parts) if parts else DASH


def usage_changelist_url(**filters: object) -> str:
    query = "&".join(f"{name}={value}" for name, value in filters.items())
    return reverse("admin:models_app_usageday_changelist") + (f"?{query}" if query else "")


def usage_context(rows: QuerySet[UsageDay], chart_id: str) -> dict[str, Any]:
    """What the usage partial shows: days (newest first), totals, and the chart's series."""
    days = usage.usage_by_day(rows=rows)
    return {
        "usage_days": list(reversed(days)),
        "usage_totals": usage.usage_totals(rows=rows),
        "usage_chart": usage.usage_chart_data(days=days),
        "usage_chart_id": chart_id,
    }


def snippet_context(base_url: str, raw_key: str) -> dict[str, Any]:
    """The snippets for each enabled alias, chat aliases first (the first one is shown), with the
    picker's choices; the agent CLIs' environment names no model, so it stands apart (KEY-1)."""
    aliases = sorted(
        selectors.aliases_enabled(),
        key=lambda alias: (alias.model.kind not in Model.GENERATING_KINDS, alias.name),
    )
    named = [(alias.name, alias.model.kind == Model.Kind.EMBEDDING) for alias in aliases]
    groups = [
        {
            "alias": name,
            "label": f"{name} (embedding)" if embedding else name,
            "snippets": key_snippets(base_url=base_url, raw_key=raw_key, model=name, embedding=embedding)[
                :-1
            ],
        }
        for name, embedding in named or [(MODEL_PLACEHOLDER, False)]
    ]
    return {"snippet_groups": groups, "env_snippet": env_snippet(base_url=base_url, raw_key=raw_key)}


class KeyStatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "active"), ("revoked", "revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() in ("active", "revoked"):
            return queryset.filter(revoked_at__isnull=self.value() == "active")
        return queryset


# API keys --------------------------------------------------------------------------------------------


@admin.register(ApiKey)
class ApiKeyAdmin(_ApiKeyAdminBase):
    """The full key appears once, on the page after creation; every other page shows its prefix."""

    form = ApiKeyChangeForm
    # Seven columns fit beside the navigation and the filter at 1280 px; created_at is on the key's page.
    list_display = ("name", "prefix", "owner", "status", "last_used", "recent_tokens", "limits")
    list_filter = (KeyStatusFilter,)
    search_fields = ("name", "prefix", "owner__username")
    list_select_related = ("owner",)
    actions = ("revoke",)
    readonly_change = ("owner", "prefix", "status", "created_at", "last_used_at", "revoked_at")

    class Media:
        css = {"all": USAGE_MEDIA_CSS}
        js = USAGE_MEDIA_JS

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        since = timezone.now().date() - timedelta(days=RECENT_DAYS - 1)
        tokens = F("usage_days__prompt_tokens") + F("usage_days__output_tokens")
        return (
            super()
            .get_queryset(request)
            .annotate(recent_tokens=Sum(tokens, filter=Q(usage_days__day__gte=since)))
        )

    @admin.display(description="status", ordering="revoked_at")
    def status(self, obj: ApiKey) -> SafeString:
        return status_badge(obj)

    @admin.display(description="last used", ordering="last_used_at")
    def last_used(self, obj: ApiKey) -> SafeString | str:
        return last_used_html(obj)

    @admin.display(description=f"tokens, {RECENT_DAYS} days", ordering="recent_tokens")
    def recent_tokens(self, obj: ApiKey) -> SafeString:
        tokens = getattr(obj, "recent_tokens", None) or 0
        return format_html('<a href="{}">{}</a>', usage_changelist_url(key__id__exact=obj.pk), f"{tokens:,}")

    @admin.display(description="limits")
    def limits(self, obj: ApiKey) -> SafeString | str:
        return limits_html(obj)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[ApiKey]]:
        if obj is None:
            kwargs["form"] = ApiKeyCreateForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> _FieldGroups:
        if obj is None:
            return list(API_KEY_CREATE_FIELDS)
        # Never the hash; the limits sit with the name, the facts below them.
        return ["name", "requests_per_minute", "tokens_per_day", *self.readonly_change]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return self.readonly_change if obj else ()

    # Creating: the secret, once -------------------------------------------------------------------

    def save_model(
        self, request: HttpRequest, obj: ApiKey, form: forms.ModelForm[ApiKey], change: bool
    ) -> None:
        if change:
            services.apikey_update(
                key=obj,
                name=obj.name,
                requests_per_minute=obj.requests_per_minute,
                tokens_per_day=obj.tokens_per_day,
            )
            return
        key, raw = services.apikey_create(
            owner=obj.owner,
            name=obj.name,
            requests_per_minute=obj.requests_per_minute,
            tokens_per_day=obj.tokens_per_day,
        )
        obj.pk, obj.prefix, obj.secret_hash, obj.created_at = (
            key.pk,
            key.prefix,
            key.secret_hash,
            key.created_at,
        )
        # Kept in this staff member's session only until the next page shows it, then dropped.
        request.session[NEW_KEY_SESSION.format(pk=key.pk)] = raw

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        if "_popup" in request.POST:
            return super().response_add(request, obj, post_url_continue)
        return redirect(reverse("admin:models_app_apikey_created", args=(quote(obj.pk),)))

    def get_urls(self) -> list[URLPattern]:
        # Before the defaults: their "<path:object_id>/" would swallow ".../created/".
        return [
            path(
                "<path:object_id>/created/",
                self.admin_site.admin_view(self.created_view),
                name="models_app_apikey_created",
            ),
            path(
                "<path:object_id>/revoke/",
                self.admin_site.admin_view(self.revoke_view),
                name="models_app_apikey_revoke",
            ),
            *super().get_urls(),
        ]

    def created_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The new key's secret with copy buttons and snippets, shown once (KEY-1)."""
        key = self.get_object(request, unquote(object_id))
        if key is None:
            raise Http404("No such API key.")
        if not self.has_view_permission(request, key):
            raise PermissionDenied
        raw = request.session.pop(NEW_KEY_SESSION.format(pk=key.pk), None)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": key,
            "title": f"API key {key.name} created" if raw else f"API key {key.name}",
            "raw_key": raw,
            **(snippet_context(request.build_absolute_uri("/"), raw) if raw else {}),
            "change_url": reverse("admin:models_app_apikey_change", args=(quote(key.pk),)),
            "list_url": reverse("admin:models_app_apikey_changelist"),
        }
        return TemplateResponse(request, "admin/models_app/apikey/created.html", context)

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        # A new key is most often the signed-in staff member's own.
        return {"owner": request.user.pk, **super().get_changeform_initial_data(request)}

    # Revoking -------------------------------------------------------------------------------------

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> TemplateResponse | None:
        """Asks first, on a page naming the keys (as Django's delete does); revokes on its POST."""
        keys = list(queryset.filter(revoked_at__isnull=True))
        if keys and request.POST.get("confirmed") != "1":
            return self._revoke_confirm(
                request, keys, action_url=reverse("admin:models_app_apikey_changelist")
            )
        self._revoke(request, keys)
        return None

    def revoke_view(self, request: HttpRequest, object_id: str) -> HttpResponseRedirect | HttpResponse:
        """GET (or a POST without `confirmed`) asks first; a confirmed POST revokes this key."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        key = self.get_object(request, unquote(object_id))
        if key is None:
            raise Http404("No such API key.")
        if not self.has_change_permission(request, key):
            raise PermissionDenied
        change_url = reverse("admin:models_app_apikey_change", args=(quote(key.pk),))
        if key.revoked_at is None and (request.method == "GET" or request.POST.get("confirmed") != "1"):
            return self._revoke_confirm(request, [key], action_url=request.path, cancel_url=change_url)
        self._revoke(request, [key] if key.revoked_at is None else [])
        return redirect(change_url)

    def _revoke_confirm(
        self, request: HttpRequest, keys: list[ApiKey], *, action_url: str, cancel_url: str = ""
    ) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Revoke this key?" if len(keys) == 1 else f"Revoke these {len(keys)} keys?",
            "keys": keys,
            "action_url": action_url,
            "from_list": not cancel_url,
            "cancel_url": cancel_url or reverse("admin:models_app_apikey_changelist"),
        }
        return TemplateResponse(request, "admin/models_app/apikey/revoke_confirm.html", context)

    def _revoke(self, request: HttpRequest, keys: list[ApiKey]) -> None:
        if not keys:
            messages.warning(request, NOTHING_REVOKED)
            return
        for key in keys:
            services.apikey_revoke(key=key, actor=request.user)
        names = ", ".join(str(key) for key in keys)
        one = len(keys) == 1
        messages.success(
            request, REVOKED.format(names=names, it="it" if one else "them", its="its" if one else "their")
        )

    # The change page: status, the revoke button, usage -----------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: ApiKey | None = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:
            since = timezone.now().date() - timedelta(days=RECENT_DAYS - 1)
            rows = UsageDay.objects.filter(key=obj, day__gte=since)
            can_revoke = obj.revoked_at is None and self.has_change_permission(request, obj)
            context.update(
                usage_context(rows, "mlxhost-key-usage"),
                key_status=status_badge(obj),
                key_last_used=last_used_html(obj),
                recent_days=RECENT_DAYS,
                revoke_url=reverse("admin:models_app_apikey_revoke", args=(quote(obj.pk),))
                if can_revoke
                else "",
                key_usage_url=usage_changelist_url(key__id__exact=obj.pk),
                owner_usage_url=usage_changelist_url(owner__id__exact=obj.owner_id),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)


# Usage by day ------------------------------------------------------------------------------------------


@admin.register(UsageDay)
class UsageDayAdmin(_UsageDayAdminBase):
    """Read-only: one row per key (or browser session) per UTC day, written by the usage flush.

    Filter by user or key for their totals by day; the chart, the daily sums and the CSV follow
    the filters (KEY-3).
    """

    # Short headers and ISO days: eight columns fit beside the navigation and the filter at 1280 px.
    list_display = (
        "day_label",
        "owner",
        "key_label",
        "requests",
        "prompt",
        "cached",
        "output",
        "total",
        "refused",
    )
    list_filter = (("owner", admin.RelatedOnlyFieldListFilter), ("key", admin.RelatedOnlyFieldListFilter))
    list_select_related = ("owner", "key")
    search_fields = ("owner__username", "key__name", "key__prefix")
    date_hierarchy = "day"
    ordering = ("-day", "owner__username", "key__name")  # one sort arrow (the day's): narrower headers
    list_per_page = 50
    empty_value_display = "browser session"  # the key filter's choice for rows without a key

    class Media:
        css = {"all": USAGE_MEDIA_CSS}
        js = USAGE_MEDIA_JS

    @admin.display(description="key", ordering="key__name")
    def key_label(self, obj: UsageDay) -> SafeString | str:
        key = obj.key
        if key is None:
            return "browser session"
        url = reverse("admin:models_app_apikey_change", args=(quote(key.pk),))
        return format_html('<a href="{}">{}</a>', url, key.name)

    @admin.display(description="day (UTC)", ordering="day")
    def day_label(self, obj: UsageDay) -> str:
        return obj.day.isoformat()

    @admin.display(description="prompt", ordering="prompt_tokens")
    def prompt(self, obj: UsageDay) -> int:
        return obj.prompt_tokens

    @admin.display(description="cached", ordering="cached_tokens")
    def cached(self, obj: UsageDay) -> int:
        return obj.cached_tokens

    @admin.display(description="output", ordering="output_tokens")
    def output(self, obj: UsageDay) -> int:
        return obj.output_tokens

    @admin.display(description="total")
    def total(self, obj: UsageDay) -> int:
        return obj.total_tokens

    @admin.display(description="refused")
    def refused(self, obj: UsageDay) -> SafeString:
        """Requests refused that day: by the key's limits (429) and by a busy model."""
        return format_html(
            '<span title="{} over the key\'s limits, {} by a busy model">{}</span>',
            obj.rate_limited,
            obj.overloaded,
            obj.rate_limited + obj.overloaded,
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        export = path(
            "export.csv", self.admin_site.admin_view(self.export_view), name="models_app_usageday_export"
        )
        return [export, *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # A page to read, not a list to pick from: Django's "Select usage by day to view" says otherwise.
        response = super().changelist_view(request, {"title": "Usage by day", **(extra_context or {})})
        context = getattr(response, "context_data", None)
        if context is not None and "cl" in context:
            rows = context["cl"].queryset
            context.update(
                usage_context(rows, "mlxhost-usage-chart"),
                usage_by_user=usage.usage_by_owner(rows=rows),
                export_url=reverse("admin:models_app_usageday_export") + context["cl"].get_query_string(),
            )
        return response

    def export_view(self, request: HttpRequest) -> StreamingHttpResponse:
        """The rows the changelist shows (same filters), as CSV (KEY-3)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        rows = self.get_changelist_instance(request).queryset
        filename = f"mlxhost-usage-{timezone.now().date().isoformat()}.csv"
        return StreamingHttpResponse(
            usage.usage_csv(rows=rows),
            content_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
