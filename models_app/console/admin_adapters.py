"""Admin pages for LoRA adapters (issue 28): registering a folder under MODELS_ROOT for a base model, checked
against it when saved (a mismatch is a form error on the field it concerns), and the aliases that use each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from models_app.catalogue import adapters
from models_app.models import Adapter, Model

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest
    from django.utils.safestring import SafeString

    _AdapterFormBase = forms.ModelForm[Adapter]
    _AdapterAdminBase = admin.ModelAdmin[Adapter]
else:
    _AdapterFormBase = forms.ModelForm
    _AdapterAdminBase = admin.ModelAdmin

DASH = "—"
ADAPTER_LABELS = {"name": "Name", "description": "Description", "base": "Base model", "local_path": "Folder"}
ADAPTER_HELP = {
    "name": "A slug for staff (letters, digits, - and _; up to 64): shown in metrics, usage and the Models page.",
    "description": "Optional, up to 200 characters: a note for staff.",
    "base": "The local chat model this adapter was trained on. It stays loaded and serves its own aliases; "
    "the adapter is loaded into it on first use.",
    "local_path": "A folder relative to MODELS_ROOT in the layout mlx_lm.lora writes: adapter_config.json and "
    "adapters.safetensors. Saving checks every adapted layer against the base (name, shape, rank).",
}


class AdapterForm(_AdapterFormBase):
    """Registers or edits an adapter: checked against its base in `clean`, so a mismatch shows on the form."""

    class Meta:
        model = Adapter
        fields = ("name", "description", "base", "local_path")
        labels = ADAPTER_LABELS
        help_texts = ADAPTER_HELP

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["base"].queryset = Model.objects.filter(kind=Model.Kind.CHAT)  # type: ignore[attr-defined]
        found = adapters.adapter_folders_available()
        if found:
            self.fields["local_path"].widget.attrs["list"] = "adapter-folders"
            options = format_html_join("", '<option value="{}">', ((f,) for f in found))
            listed = ", ".join(found[:10])
            self.fields["local_path"].help_text = format_html(
                '{} Found under MODELS_ROOT: {}.<datalist id="adapter-folders">{}</datalist>',
                ADAPTER_HELP["local_path"],
                listed,
                options,
            )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        base, path = cleaned.get("base"), cleaned.get("local_path")
        if base is not None and path:
            try:
                adapters.adapter_check(adapter=Adapter(base=base, local_path=path))
            except ValidationError as exc:
                self.add_error(None, exc)  # a dict: each message on its field
        return cleaned


@admin.register(Adapter)
class AdapterAdmin(_AdapterAdminBase):
    """LoRA adapters of base models; aliases choose one on their own page."""

    form = AdapterForm
    list_display = ("name", "base", "local_path", "rank", "scale", "layers", "used_by", "short_fingerprint")
    list_filter = ("base",)
    list_select_related = ("base",)
    search_fields = ("name", "description", "local_path", "base__name")
    readonly_fields = (
        "fingerprint",
        "rank",
        "scale",
        "layers",
        "nbytes",
        "used_by",
        "created_at",
        "updated_at",
    )
    fieldsets = (
        (None, {"fields": ("name", "description", "base", "local_path")}),
        ("What the check found", {"fields": ("rank", "scale", "layers", "nbytes", "fingerprint")}),
        ("Served as", {"fields": ("used_by",)}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Adapter]:
        return super().get_queryset(request).prefetch_related("aliases")

    @admin.display(description="aliases")
    def used_by(self, obj: Adapter) -> SafeString | str:
        if obj.pk is None:
            return DASH
        links = [
            (reverse("admin:models_app_modelalias_change", args=(quote(alias.pk),)), alias.name)
            for alias in obj.aliases.all()
        ]
        return format_html_join(", ", '<a href="{}">{}</a>', links) if links else DASH

    @admin.display(description="fingerprint")
    def short_fingerprint(self, obj: Adapter) -> str:
        return obj.fingerprint[:16]

    def save_model(self, request: HttpRequest, obj: Adapter, form: Any, change: bool) -> None:
        adapters.adapter_save(adapter=obj)  # no actor: the change form records its own save (ADM-6)

    def delete_model(self, request: HttpRequest, obj: Adapter) -> None:
        adapters.adapter_delete(adapter=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> None:
        for adapter in queryset:
            adapters.adapter_delete(adapter=adapter)
