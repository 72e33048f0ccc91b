"""Admin pages for models, aliases, instances, stored responses and tombstones; writes go through
services. API keys and their usage are in `models_app.console.admin_keys`, registered from here."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from mlxhost.engine import ALIAS_SAMPLING_FIELDS
from models_app.catalogue import control, selectors, services
from models_app.console import admin_keys as admin_keys  # registers the API key and usage pages (KEY-1..4)
from models_app.console.forms import ALIAS_FORM_FIELDS as ALIAS_FORM_FIELDS  # re-exported for tests
from models_app.console.forms import MODEL_FORM_FIELDS as MODEL_FORM_FIELDS
from models_app.console.forms import ModelAliasForm, ModelForm
from models_app.console.live_state import AliasLiveState, alias_live_state, live_views, model_live_state
from models_app.models import InstanceTombstone, Model, ModelAlias, ModelInstance, StoredResponse
from models_app.turns import transcripts

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from django import forms
    from django.db.models import QuerySet
    from django.utils.safestring import SafeString

    # django-stubs makes the admin classes generic over their model, but Django's are not
    # subscriptable at runtime (django_stubs_ext.monkeypatch would make them so; dev-only here).
    _AliasInlineBase = admin.TabularInline[ModelAlias, Model]
    _ModelAdminBase = admin.ModelAdmin[Model]
    _ModelAliasAdminBase = admin.ModelAdmin[ModelAlias]
    _ModelInstanceAdminBase = admin.ModelAdmin[ModelInstance]
    _StoredResponseAdminBase = admin.ModelAdmin[StoredResponse]
    _InstanceTombstoneAdminBase = admin.ModelAdmin[InstanceTombstone]
else:
    _AliasInlineBase = admin.TabularInline
    _ModelAdminBase = _ModelAliasAdminBase = _ModelInstanceAdminBase = admin.ModelAdmin
    _StoredResponseAdminBase = _InstanceTombstoneAdminBase = admin.ModelAdmin

ACTION_REQUESTED = "{action} requested for {names}; progress shows here and on the dashboard."
DASH = "—"
# LANE-1: a concurrency above 1 on weights that cannot batch is clamped to 1 by the engine.
CANNOT_BATCH_NOTE = (
    "This model cannot batch (its KV cache cannot merge sequences), so it serves one request at a "
    "time whatever its concurrency says; the others wait in its queue."
)


# Live state, rendered ----------------------------------------------------------------------------


def live_state_html(live: AliasLiveState) -> SafeString:
    """The state badge, with a progress bar while loading and the reason of an error."""
    badge = format_html('<span class="mlxhost-state mlxhost-state-{}">{}</span>', live.state, live.label)
    if live.state == "loading":
        percent = live.progress_percent
        if percent is None:  # nothing to count (starting, checking, building): an indeterminate bar
            return format_html(
                '{} <progress class="mlxhost-progress"></progress> {}',
                badge,
                live.progress_words or "starting",
            )
        return format_html(
            '{} <progress class="mlxhost-progress" value="{}" max="100" title="{} of {}">{}%</progress> {}: {}%',
            badge,
            percent,
            live.progress_done,
            live.progress_total,
            percent,
            live.progress_words or "loading",
            percent,
        )
    if live.state == "error":
        return format_html('{} <span class="mlxhost-error">{}</span>', badge, live.error)
    return badge


def live_load_text(live: AliasLiveState, *, short: bool = False) -> str:
    if not live.resident_counts:
        return DASH
    if short:
        clamped = " (cannot batch)" if live.cannot_batch else ""
        return f"{live.active} / {live.queued} / {live.capacity}{clamped}"
    text = f"{live.active} active / {live.queued} queued (capacity {live.capacity})"
    if live.cannot_batch:
        text += f". {CANNOT_BATCH_NOTE}"
    return text


def last_action_html(live: AliasLiveState) -> SafeString | str:
    if not live.last_action:
        return DASH
    return format_html(
        '<span class="mlxhost-action mlxhost-action-{}">{}</span>', live.last_action_state, live.last_action
    )


class _LiveColumns:
    """The changelist's live columns for one request: one status read per page, one state per row."""

    def __init__(self) -> None:
        self.views, self.actions = live_views()
        self._states: dict[tuple[str, int], AliasLiveState] = {}

    def state_of(self, obj: Model | ModelAlias) -> AliasLiveState:
        key = (type(obj).__name__, obj.pk)
        if key not in self._states:
            if isinstance(obj, Model):
                state = model_live_state(model=obj, views=self.views, actions=self.actions)
            else:
                state = alias_live_state(alias=obj, views=self.views, actions=self.actions)
            self._states[key] = state
        return self._states[key]

    def columns(self) -> tuple[Callable[[Any], Any], ...]:
        @admin.display(description="live state")
        def live_state(obj: Model | ModelAlias) -> SafeString:
            return live_state_html(self.state_of(obj))

        @admin.display(description="instance")
        def instance_live(obj: Model | ModelAlias) -> str:
            instance_id = self.state_of(obj).instance_id
            return f"#{instance_id}" if instance_id else DASH

        @admin.display(description="active / queued / capacity")
        def requests_live(obj: Model | ModelAlias) -> str:
            return live_load_text(self.state_of(obj), short=True)

        @admin.display(description="prefix cache")
        def warm_sessions(obj: Model | ModelAlias) -> str:
            live = self.state_of(obj)
            if not live.resident_counts:
                return DASH
            hits = live.cache_hit_percent
            return f"{live.warm_sessions} · {hits}% hits" if hits is not None else str(live.warm_sessions)

        @admin.display(description="last action")
        def last_action(obj: Model | ModelAlias) -> SafeString | str:
            return last_action_html(self.state_of(obj))

        return (live_state, instance_live, requests_live, warm_sessions, last_action)


def _live_columns(request: HttpRequest) -> _LiveColumns:
    columns: _LiveColumns | None = getattr(request, "_mlxhost_live_columns", None)
    if columns is None:  # Django asks more than once per page; read the engines' status once
        columns = _LiveColumns()
        request._mlxhost_live_columns = columns  # type: ignore[attr-defined]  # a per-request memo
    return columns


def _live_context(live: AliasLiveState) -> dict[str, Any]:
    return {
        "live": live,
        "live_state_html": live_state_html(live),
        "live_load_text": live_load_text(live),
        "last_action_html": last_action_html(live),
    }


# Models ---------------------------------------------------------------------------------------------


class AliasInline(_AliasInlineBase):
    """The aliases a model serves, read-only here: each is edited on its own page."""

    model = ModelAlias
    fields = ("name", "enabled", "temperature", "max_tokens", "max_output_tokens")
    readonly_fields = fields
    show_change_link = True
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Model)
class ModelAdmin(_ModelAdminBase):
    """Weights, their admission lane and memory policy, and the load / unload / reload actions."""

    form = ModelForm
    list_display = ("name", "served_as", "weights", "kind", "pinned", "concurrency")
    list_filter = ("kind", "pinned", "source_kind")
    search_fields = ("name", "local_path", "hf_repo", "description", "aliases__name")
    readonly_fields = ("instance", "created_at", "updated_at")
    actions = ("load", "unload", "reload")
    inlines = (AliasInline,)
    fieldsets = (
        (None, {"fields": ("name", "description", "pinned", "instance")}),
        (
            "Weights",
            {"fields": ("source_kind", "local_path", "hf_repo", "hf_revision", "kind", "matryoshka")},
        ),
        (
            "Admission lane (shared by every alias of this model)",
            {"fields": ("concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s")},
        ),
        ("Memory", {"fields": ("keep_alive_s",)}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Model]:
        return super().get_queryset(request).prefetch_related("aliases")

    @admin.display(description="aliases")
    def served_as(self, obj: Model) -> str:
        return ", ".join(alias.name for alias in obj.aliases.all()) or DASH

    @admin.display(description="weights")
    def weights(self, obj: Model) -> str:
        return obj.source_label

    def get_list_display(self, request: HttpRequest) -> tuple[Any, ...]:
        name, aliases, weights, *rest = self.list_display
        return (name, aliases, weights, *_live_columns(request).columns(), *rest)

    @admin.action(description="Load selected models", permissions=["change"])
    def load(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        self._request_actions(request, queryset, "load")

    @admin.action(description="Unload selected models", permissions=["change"])
    def unload(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        self._request_actions(request, queryset, "unload")

    @admin.action(
        description="Reload selected models (the old weights serve until the new are in)",
        permissions=["change"],
    )
    def reload(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        self._request_actions(request, queryset, "reload")

    def _request_actions(
        self, request: HttpRequest, models: Iterable[Model], action: str, *, host: int | None = None
    ) -> None:
        # Only services talk to the engines (and record the request in the history, ADM-6);
        # this collects their answers into messages.
        requested: list[str] = []
        for model in models:
            try:
                services.model_request_action(model=model, action=action, actor=request.user, host=host)
            except ValidationError as exc:
                messages.error(request, "; ".join(exc.messages))
                continue
            requested.append(model.name)
        if requested:
            messages.success(
                request, ACTION_REQUESTED.format(action=action.capitalize(), names=", ".join(requested))
            )

    # The change page and its action buttons ---------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        # Before the defaults: their "<path:object_id>/" would swallow ".../action/load/".
        action = path(
            "<path:object_id>/action/<str:action>/",
            self.admin_site.admin_view(self.action_view),
            name="models_app_model_action",
        )
        return [action, *super().get_urls()]

    def action_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """POST only: ask the engines to load, unload or reload this model (ADM-1); a `host`
        field names one fleet host, none asks them all (a reload then rolls, issue 15)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        model = self.get_object(request, unquote(object_id))
        if model is None:
            raise Http404("No such model.")
        if not self.has_change_permission(request, model):
            raise PermissionDenied
        host = request.POST.get("host") or None
        if host is not None and (not host.isdigit() or int(host) not in control.fleet_hosts()):
            messages.error(request, f"No fleet host {host} is running.")
        else:
            self._request_actions(request, [model], action, host=int(host) if host else None)
        return redirect(reverse("admin:models_app_model_change", args=(quote(model.pk),)))

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Model | None = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:
            views, actions = live_views()
            live = model_live_state(model=obj, views=views, actions=actions)
            add_alias = reverse("admin:models_app_modelalias_add") + f"?model={obj.pk}"
            context.update(
                _live_context(live),
                model_actions=self._action_buttons(request, obj),
                fleet_hosts=[(host, f"h{host:02d}") for host in control.fleet_hosts()],
                add_alias_url=add_alias,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _action_buttons(self, request: HttpRequest, model: Model) -> list[dict[str, Any]]:
        if not self.has_change_permission(request, model):
            return []
        return [
            {
                "name": action,
                "label": action.capitalize(),
                "url": reverse("admin:models_app_model_action", args=(quote(model.pk), action)),
            }
            for action in control.ACTIONS
        ]

    # Writes ---------------------------------------------------------------------------------------

    def save_model(
        self, request: HttpRequest, obj: Model, form: forms.ModelForm[Model], change: bool
    ) -> None:
        try:  # no actor: the change form records this save in the history itself (ADM-6)
            services.model_save(model=obj)
        except ValidationError as exc:  # the folder changed between clean() and save
            messages.error(request, "; ".join(exc.messages))
            raise

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        services.model_delete(model=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        for model in queryset:
            services.model_delete(model=model)


# Aliases -------------------------------------------------------------------------------------------


@admin.register(ModelAlias)
class ModelAliasAdmin(_ModelAliasAdminBase):
    """Public names: sampling defaults and limits. Weights, lane and actions are on the model."""

    form = ModelAliasForm
    list_display = ("name", "model_link", "kind", "enabled", "temperature", "max_tokens", "updated_at")
    list_filter = ("enabled", "model")
    list_select_related = ("model", "model__instance")
    search_fields = ("name", "description", "model__name")
    readonly_fields = ("created_at", "updated_at")

    @admin.display(description="kind", ordering="model__kind")
    def kind(self, obj: ModelAlias) -> str:
        return obj.model.get_kind_display()

    fieldsets = (
        (None, {"fields": ("name", "description", "model", "enabled")}),
        (
            "Sampling defaults",
            {"fields": ALIAS_SAMPLING_FIELDS},
        ),
        ("Limits", {"fields": ("max_output_tokens", "max_input_tokens")}),
        ("Chat template", {"fields": ("enable_thinking", "chat_template_kwargs")}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    @admin.display(description="model", ordering="model__name")
    def model_link(self, obj: ModelAlias) -> SafeString:
        url = reverse("admin:models_app_model_change", args=(quote(obj.model_id),))
        return format_html('<a href="{}">{}</a>', url, obj.model.name)

    def get_list_display(self, request: HttpRequest) -> tuple[Any, ...]:
        name, model, *rest = self.list_display
        live_state, instance_live, requests_live, *_ = _live_columns(request).columns()
        return (name, model, live_state, instance_live, requests_live, *rest)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: ModelAlias | None = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:
            views, actions = live_views()
            live = alias_live_state(alias=obj, views=views, actions=actions)
            model_url = reverse("admin:models_app_model_change", args=(quote(obj.model_id),))
            context.update(_live_context(live), model_url=model_url, model_name=obj.model.name)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def save_model(
        self, request: HttpRequest, obj: ModelAlias, form: forms.ModelForm[ModelAlias], change: bool
    ) -> None:
        services.alias_save(alias=obj)  # no actor: the change form records its own save (ADM-6)

    def delete_model(self, request: HttpRequest, obj: ModelAlias) -> None:
        services.alias_delete(alias=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ModelAlias]) -> None:
        for alias in queryset:
            services.alias_delete(alias=alias)


@admin.register(ModelInstance)
class ModelInstanceAdmin(_ModelInstanceAdminBase):
    list_display = (
        "id",
        "source_kind",
        "source",
        "revision",
        "short_fingerprint",
        "created_at",
        "retired_at",
    )
    readonly_fields = [f.name for f in ModelInstance._meta.fields]

    @admin.display(description="fingerprint")
    def short_fingerprint(self, obj: ModelInstance) -> str:
        return obj.fingerprint[:16]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# Stored responses ------------------------------------------------------------------------------------

PREVIEW_PROMPT_CHARS = 140
PREVIEW_ANSWER_CHARS = 280


def _continue_url(response: StoredResponse) -> str:
    """The chat page, reopening the conversation that ends at `response` (its owner's only)."""
    return reverse("dashboard:chat") + "?" + urlencode({"response": response.public_id})


def _shorten(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


@admin.register(StoredResponse)
class StoredResponseAdmin(_StoredResponseAdminBase):
    """Read-only (staff may delete), searchable, with a chain view per row."""

    # A preview of the turn, not ids only (ADM-5); the instance and expiry are on the row's page.
    list_display = ("public_id", "preview", "alias_name", "owner", "status", "chain_link", "created_at")
    list_filter = ("status", "alias_name")
    list_select_related = ("owner",)
    # The prompt lives in JSON: `request__input` is a key transform, matched as text by icontains on
    # SQLite (JSON_EXTRACT) and PostgreSQL (->>) alike (ADM-5).
    search_fields = (
        "public_id",
        "previous_response_id",
        "alias_name",
        "owner__username",
        "output_text",
        "request__input",
        "request__instructions",
    )
    readonly_fields = [f.name for f in StoredResponse._meta.fields]
    # The conversation is rendered above these (change_form.html); the raw JSON stays, folded.
    fieldsets = (
        (None, {"fields": ("public_id", "owner", "alias_name", "status", "previous_response_id")}),
        ("Dates", {"fields": ("created_at", "updated_at", "expires_at")}),
        ("Weights", {"fields": ("alias", "instance_id", "weights_fingerprint", "boot_id")}),
        ("Raw JSON", {"fields": ("request", "output", "output_text", "usage"), "classes": ("collapse",)}),
    )

    class Media:
        # The answer's preview is Markdown, rendered by the chat page's renderer (DOM nodes only,
        # so markup in model output never runs); without script it reads as plain text.
        css = {"all": ("mlxhost/chat.css",)}
        js = ("mlxhost/markdown.js", "mlxhost/stored_responses.js")

    @admin.display(description="prompt and answer")
    def preview(self, obj: StoredResponse) -> SafeString:
        prompt = _shorten(selectors.response_input_text(response=obj), PREVIEW_PROMPT_CHARS)
        answer = _shorten(obj.output_text, PREVIEW_ANSWER_CHARS)
        return format_html(
            '<div class="mlxhost-preview"><p class="mlxhost-preview-prompt">{}</p>'
            '<div class="mlxhost-preview-answer chat-md" data-markdown>{}</div></div>',
            prompt or "(no text input)",
            answer or "(no answer text)",
        )

    @admin.display(description="chain")
    def chain_link(self, obj: StoredResponse) -> SafeString:
        url = reverse("admin:models_app_storedresponse_chain", args=(quote(obj.pk),))
        label = "earlier turns" if obj.previous_response_id else "first turn"
        return format_html('<a href="{}">{}</a>', url, label)

    def get_list_display(
        self, request: HttpRequest
    ) -> tuple[str | Callable[[StoredResponse], str | bool], ...]:
        # The chat page reopens only its user's own conversations (PER-6): link those.
        viewer = request.user.pk

        @admin.display(description="continue")
        def continue_link(obj: StoredResponse) -> str:
            if obj.owner_id != viewer:
                return format_html('<span class="mlxhost-muted">{}</span>', "another user's")
            return format_html('<a href="{}" class="mlxhost-continue">in chat</a>', _continue_url(obj))

        return (*self.list_display, continue_link)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[StoredResponse], search_term: str
    ) -> tuple[QuerySet[StoredResponse], bool]:
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        if not search_term.isascii():
            # SQLite keeps JSON as text with non-ASCII letters escaped ("K\\u00e4se"): search that
            # spelling too, or a prompt word like "Käse" is found on PostgreSQL only (ADM-5).
            escaped = "".join(c if c.isascii() else json.dumps(c)[1:-1] for c in search_term)
            also, more = super().get_search_results(request, queryset, escaped)
            found, may_have_duplicates = found | also, may_have_duplicates or more
        return found, may_have_duplicates

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: StoredResponse | None = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:  # the conversation instead of raw JSON (ADM-5)
            transcript = transcripts.response_transcript(response=obj)
            context.update(
                transcript=transcript,
                previous_url=self._change_url(transcript.previous),
                next_links=[(row.public_id, self._change_url(row)) for row in transcript.next],
                continue_url=_continue_url(obj) if obj.owner_id == request.user.pk else "",
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _change_url(self, row: StoredResponse | None) -> str:
        return reverse("admin:models_app_storedresponse_change", args=(quote(row.pk),)) if row else ""

    def get_urls(self) -> list[URLPattern]:
        chain = path(
            "<path:object_id>/chain/",
            self.admin_site.admin_view(self.chain_view),
            name="models_app_storedresponse_chain",
        )
        return [chain, *super().get_urls()]

    def chain_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Every turn from the conversation's root to this row, within the row's owner."""
        response = self.get_object(request, unquote(object_id))
        if response is None:
            raise Http404("No such stored response.")
        if not self.has_view_permission(request, response):
            raise PermissionDenied
        chain = selectors.response_chain(response=response)
        turns = [
            {
                "row": row,
                "input_text": selectors.response_input_text(response=row),
                "url": reverse("admin:models_app_storedresponse_change", args=(quote(row.pk),)),
                "current": row.pk == response.pk,
            }
            for row in chain.turns
        ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Conversation chain of {response.public_id}",
            "original": response,
            "chain": chain,
            "turns": turns,
            "is_nav_sidebar_enabled": False,  # the turns' text needs the width (ADM-9)
        }
        return TemplateResponse(request, "admin/models_app/storedresponse/chain.html", context)


@admin.register(InstanceTombstone)
class InstanceTombstoneAdmin(_InstanceTombstoneAdminBase):
    """Read-only: the persist breaker writes these, the tombstone sweep deletes them (REG-7)."""

    list_display = ("instance_id", "source", "revision", "response_public_id", "created_at", "expires_at")
    search_fields = ("response_public_id", "source")
    readonly_fields = [f.name for f in InstanceTombstone._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
