"""Admin pages for models, aliases and instances; writes go through services. Registered from
here too: API keys and their usage (`admin_keys`), stored responses and tombstones
(`admin_responses`); the live state columns and panels are `admin_live`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from mlxhost.engine import ALIAS_SAMPLING_FIELDS, VISION_EXTRA, vision_extra_installed
from models_app.catalogue import control, services
from models_app.console import admin_adapters as admin_adapters  # registers LoRA adapters (issue 28)
from models_app.console import admin_keys as admin_keys  # registers the API key and usage pages (KEY-1..4)
from models_app.console import admin_responses as admin_responses  # registers stored responses (ADM-5)
from models_app.console.admin_hub import HUB_ACTIONS, HubPinActions
from models_app.console.admin_live import DASH, live_columns, live_context
from models_app.console.admin_quantize import QuantizeAdminMixin  # also registers quantized copies
from models_app.console.forms import ALIAS_FORM_FIELDS as ALIAS_FORM_FIELDS  # re-exported for tests
from models_app.console.forms import ALIAS_LABELS, ModelAliasForm, ModelForm
from models_app.console.forms import MODEL_FORM_FIELDS as MODEL_FORM_FIELDS
from models_app.console.model_costs import model_costs
from models_app.models import Model, ModelAlias, ModelInstance

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
else:
    _AliasInlineBase = admin.TabularInline
    _ModelAdminBase = _ModelAliasAdminBase = _ModelInstanceAdminBase = admin.ModelAdmin

ACTION_REQUESTED = "{action} requested for {names}; progress shows here and on the dashboard."


# Models ---------------------------------------------------------------------------------------------


def alias_column(name: str) -> Callable[[Any, ModelAlias], Any]:
    """An alias field as an admin's read-only column (a method), headed by the alias form's label
    (`ALIAS_LABELS`), so a column and the form field it shows are called the same everywhere."""

    def column(admin_: Any, alias: ModelAlias) -> Any:
        return getattr(alias, name)

    return admin.display(description=ALIAS_LABELS[name], ordering=name)(column)


class AliasInline(_AliasInlineBase):
    """The aliases a model serves, read-only here: each is edited on its own page."""

    model = ModelAlias
    fields = ("name", "adapter", "enabled", "temperature", "default_output_tokens", "output_token_clamp")
    readonly_fields = fields
    default_output_tokens = alias_column("max_tokens")
    output_token_clamp = alias_column("max_output_tokens")
    show_change_link = True
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Model)
class ModelAdmin(HubPinActions, QuantizeAdminMixin, _ModelAdminBase):
    """Weights, their admission lane and memory policy, and the load / unload / reload actions."""

    form = ModelForm
    list_display = ("name", "served_as", "weights", "kind", "pinned", "concurrency")
    list_filter = ("kind", "pinned", "source_kind")
    search_fields = ("name", "local_path", "hf_repo", "description", "aliases__name")
    readonly_fields = ("instance", "hf_sha", "created_at", "updated_at")
    actions = ("load", "unload", "reload", *HUB_ACTIONS)
    inlines = (AliasInline,)
    fieldsets = (
        (None, {"fields": ("name", "description", "pinned", "instance")}),
        (
            "Weights",
            {
                "fields": (
                    "source_kind",
                    "local_path",
                    "hf_repo",
                    "hf_revision",
                    "hf_sha",
                    "kind",
                    "matryoshka",
                )
            },
        ),
        (
            "Admission lane (shared by every alias of this model)",
            {"fields": ("concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s")},
        ),
        ("Memory", {"fields": ("keep_alive_s",)}),
        ("KV cache", {"fields": ("kv_bits", "kv_group_size", "kv_quantized_start")}),
        ("Speculative decoding", {"fields": ("draft_model",)}),
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
        return (name, aliases, weights, *live_columns(request).columns(), *rest)

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
            add_alias = reverse("admin:models_app_modelalias_add") + f"?model={obj.pk}"
            context.update(
                live_context(obj),
                model_actions=self._action_buttons(request, obj),
                fleet_hosts=[(host, f"h{host:02d}") for host in control.fleet_hosts()],
                add_alias_url=add_alias,
                costs=model_costs(obj),
                **self.quantize_context(request, obj),
            )
        if obj is not None and obj.kind == Model.Kind.VISION:
            vision_notes(request)
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


VISION_EXCLUSIVE = (
    "Vision models run one request at a time (mlx-vlm, issue 29): batching vision rows is not done "
    "yet, so this model's lane serves at capacity 1 whatever its concurrency says."
)


def vision_notes(request: HttpRequest) -> None:
    """A vision model's page says what to install when the vision extra is missing, and that it
    serves one request at a time."""
    if not vision_extra_installed():
        messages.warning(request, VISION_EXTRA)
    messages.info(request, VISION_EXCLUSIVE)


# Aliases -------------------------------------------------------------------------------------------


@admin.register(ModelAlias)
class ModelAliasAdmin(_ModelAliasAdminBase):
    """Public names: sampling defaults and limits. Weights, lane and actions are on the model."""

    form = ModelAliasForm
    list_display = (
        "name",
        "model_link",
        "adapter",
        "kind",
        "enabled",
        "temperature",
        "default_output_tokens",
        "updated_at",
    )
    default_output_tokens = alias_column("max_tokens")
    list_filter = ("enabled", "model")
    list_select_related = ("model", "model__instance", "adapter")
    search_fields = ("name", "description", "model__name")
    readonly_fields = ("created_at", "updated_at")

    @admin.display(description="kind", ordering="model__kind")
    def kind(self, obj: ModelAlias) -> str:
        return obj.model.get_kind_display()

    fieldsets = (
        (None, {"fields": ("name", "description", "model", "adapter", "enabled")}),
        (
            "Sampling defaults",
            {"fields": ALIAS_SAMPLING_FIELDS},
        ),
        ("Limits", {"fields": ("max_output_tokens", "max_input_tokens")}),
        ("Chat template", {"fields": ("enable_thinking", "chat_template_kwargs")}),
        ("Speculative decoding", {"fields": ("speculation", "speculation_max_k")}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    @admin.display(description="model", ordering="model__name")
    def model_link(self, obj: ModelAlias) -> SafeString:
        url = reverse("admin:models_app_model_change", args=(quote(obj.model_id),))
        return format_html('<a href="{}">{}</a>', url, obj.model.name)

    def get_list_display(self, request: HttpRequest) -> tuple[Any, ...]:
        name, model, *rest = self.list_display
        live_state, instance_live, requests_live, *_ = live_columns(request).columns()
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
            model_url = reverse("admin:models_app_model_change", args=(quote(obj.model_id),))
            context.update(live_context(obj), model_url=model_url, model_name=obj.model.name)
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
