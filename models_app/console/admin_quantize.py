"""The admin's quantized copies (issue 28, item 2): the Models action "Make quantized copy", its form
page, the copies' list with their stage, and the model page's panel of what each copy costs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q
from django.shortcuts import redirect
from django.template.defaultfilters import filesizeformat
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from mlxhost.engine import QUANT_BITS, QUANT_GROUP_SIZES
from models_app.catalogue.quantize import quantized_copy_request
from models_app.console.admin_live import DASH, live_state_of
from models_app.console.live_state import live_views
from models_app.models import Model, QuantizedCopy

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest, HttpResponse
    from django.utils.safestring import SafeString

    _CopyAdminBase = admin.ModelAdmin[QuantizedCopy]
else:
    _CopyAdminBase = admin.ModelAdmin

ACTION_NAME = "make_quantized_copy"
REQUESTED = "Quantized copy requested for {names}; its stage shows on the quantized copies page."


class QuantizeForm(forms.Form):
    """The copy's settings: mlx-lm's affine quantization, `bits` per weight, one scale per `group_size`."""

    bits = forms.TypedChoiceField(
        label="bits per weight",
        choices=[(b, f"{b}-bit") for b in QUANT_BITS],
        coerce=int,
        initial=4,
        help_text="4-bit is about a quarter of 16-bit weights' size, 8-bit about half; 8-bit stays closer to the original.",
    )
    group_size = forms.TypedChoiceField(
        label="group size",
        choices=[(g, str(g)) for g in QUANT_GROUP_SIZES],
        coerce=int,
        initial=64,
        help_text=(
            "Weights that share one scale and bias. Smaller groups are more exact and a little larger; "
            "a layer whose width is not a multiple of it stays unquantized."
        ),
    )


class QuantizeAdminMixin:
    """ModelAdmin's part for quantized copies: the action, its form page and the change page's panel."""

    admin_site: admin.AdminSite

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions: dict[str, Any] = super().get_actions(request)  # type: ignore[misc]  # ModelAdmin's
        if IS_POPUP_VAR not in request.GET and request.user.has_perm("models_app.add_model"):
            actions[ACTION_NAME] = (
                type(self).make_quantized_copy,
                ACTION_NAME,
                "Make quantized copy of selected models…",
            )
        return actions

    def make_quantized_copy(self, request: HttpRequest, queryset: QuerySet[Model]) -> HttpResponse:
        ids = ",".join(str(pk) for pk in queryset.values_list("pk", flat=True))
        return redirect(reverse("admin:models_app_model_quantize") + f"?ids={ids}")

    def get_urls(self) -> list[URLPattern]:
        # Before the defaults, whose "<path:object_id>/" would swallow "quantize/".
        quantize = path(
            "quantize/", self.admin_site.admin_view(self.quantize_view), name="models_app_model_quantize"
        )
        return [quantize, *super().get_urls()]  # type: ignore[misc]  # ModelAdmin's

    def quantize_view(self, request: HttpRequest) -> HttpResponse:
        """The intermediate page: the chosen models and the copy's settings; POST queues one copy each."""
        if not request.user.has_perm("models_app.add_model"):
            raise PermissionDenied
        raw = request.POST.get("ids") if request.method == "POST" else request.GET.get("ids")
        ids = [int(part) for part in (raw or "").split(",") if part.isdigit()]
        models = list(Model.objects.filter(pk__in=ids))
        form = QuantizeForm(request.POST if request.method == "POST" else None)
        if request.method == "POST" and models and form.is_valid():
            self._request_copies(request, models, form.cleaned_data["bits"], form.cleaned_data["group_size"])
            return redirect(reverse("admin:models_app_quantizedcopy_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": "Make quantized copy",
            "opts": Model._meta,
            "form": form,
            "models": models,
            "ids": ",".join(str(m.pk) for m in models),
        }
        return TemplateResponse(request, "admin/models_app/model/quantize.html", context)

    def _request_copies(self, request: HttpRequest, models: list[Model], bits: int, group_size: int) -> None:
        requested: list[str] = []
        for model in models:
            try:
                quantized_copy_request(model=model, bits=bits, group_size=group_size, actor=request.user)
            except ValidationError as exc:
                messages.error(request, f"{model.name}: {'; '.join(exc.messages)}")
                continue
            requested.append(model.name)
        if requested:
            messages.success(request, REQUESTED.format(names=", ".join(requested)))

    def quantize_context(self, request: HttpRequest, model: Model) -> dict[str, Any]:
        """The change page's panel: this model beside its copies (or its original), measured."""
        copies = QuantizedCopy.objects.filter(Q(source=model) | Q(result=model)).select_related(
            "source", "result"
        )
        url = ""
        if request.user.has_perm("models_app.add_model"):
            url = reverse("admin:models_app_model_quantize") + f"?ids={model.pk}"
        views, actions = live_views()  # one status read for the panel's "served now" column

        def served(other: Model | None) -> str:
            live = live_state_of(other, views, actions) if other is not None else None
            if live is None or not live.resident_counts or not live.tokens_per_s:
                return DASH
            return f"{live.tokens_per_s:.1f} tok/s"

        rows = [
            {**copy_row(c), "source_served": served(c.source), "result_served": served(c.result)}
            for c in copies[:20]
        ]
        return {"quantized_copies": rows, "quantize_url": url}


def copy_row(copy: QuantizedCopy) -> dict[str, Any]:
    """One copy as the panel and the list show it: the original's and the copy's measured costs."""
    return {
        "copy": copy,
        "state": copy_state(copy),
        "source": (copy.source_bytes, copy.source_load_s, copy.source_tokens_per_s),
        "result": (copy.copy_bytes, copy.copy_load_s, copy.copy_tokens_per_s),
        "ratio": f"{copy.copy_bytes / copy.source_bytes:.0%}"
        if copy.copy_bytes and copy.source_bytes
        else DASH,
    }


def copy_state(copy: QuantizedCopy) -> str:
    """ "Running: quantizing", "Failed: <why>", "Done", ... in words."""
    if copy.status == QuantizedCopy.Status.RUNNING and copy.stage:
        return f"Running: {copy.get_stage_display().lower()}"
    if copy.status == QuantizedCopy.Status.FAILED:
        return f"Failed: {copy.error}"
    return copy.get_status_display()


@admin.register(QuantizedCopy)
class QuantizedCopyAdmin(_CopyAdminBase):
    """Quantized copies, read-only: made by the Models action, each with its stage and measurements."""

    list_display = (
        "__str__",
        "state",
        "copy_link",
        "size",
        "load_time",
        "decode_speed",
        "created_at",
    )
    list_filter = ("status", "bits", "group_size")
    list_select_related = ("source", "result")
    readonly_fields = [f.name for f in QuantizedCopy._meta.fields]

    @admin.display(description="state", ordering="status")
    def state(self, obj: QuantizedCopy) -> str:
        return copy_state(obj)

    @admin.display(description="copy")
    def copy_link(self, obj: QuantizedCopy) -> SafeString | str:
        if obj.result is None:
            return DASH
        url = reverse("admin:models_app_model_change", args=(quote(obj.result.pk),))
        return format_html('<a href="{}">{}</a>', url, obj.result.name)

    @admin.display(description="size on disk (original → copy)")
    def size(self, obj: QuantizedCopy) -> str:
        return _pair(obj.source_bytes, obj.copy_bytes, filesizeformat)

    @admin.display(description="load time")
    def load_time(self, obj: QuantizedCopy) -> str:
        return _pair(obj.source_load_s, obj.copy_load_s, lambda s: f"{s:.2f} s")

    @admin.display(description="decode speed")
    def decode_speed(self, obj: QuantizedCopy) -> str:
        return _pair(obj.source_tokens_per_s, obj.copy_tokens_per_s, lambda t: f"{t:.1f} tok/s")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _pair(before: float | None, after: float | None, shown: Any) -> str:
    if before is None or after is None:
        return DASH
    return f"{shown(before)} → {shown(after)}"
