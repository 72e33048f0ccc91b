"""Admin pages for aliases, instances, API keys, stored responses and tombstones; writes go through services."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest

from models_app import services
from models_app.models import ApiKey, InstanceTombstone, ModelAlias, ModelInstance, StoredResponse

ALIAS_FORM_FIELDS = (
    "name", "description", "enabled", "pinned",
    "source_kind", "local_path", "hf_repo", "hf_revision",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens",
    "max_output_tokens", "max_input_tokens",
    "concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s", "keep_alive_s",
)  # fmt: skip


class ModelAliasForm(forms.ModelForm):
    class Meta:
        model = ModelAlias
        fields = ALIAS_FORM_FIELDS

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if not self.errors:
            for field, value in cleaned.items():
                setattr(self.instance, field, value)
            # Validates the weights source (folder safety, pinned revision) before save_model runs.
            services.alias_source_check(alias=self.instance)
        return cleaned


@admin.register(ModelAlias)
class ModelAliasAdmin(admin.ModelAdmin):
    form = ModelAliasForm
    list_display = (
        "name",
        "source_label",
        "instance_id_display",
        "enabled",
        "pinned",
        "concurrency",
        "updated_at",
    )
    list_filter = ("enabled", "pinned", "source_kind")
    search_fields = ("name", "local_path", "hf_repo", "description")
    readonly_fields = ("instance", "created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("name", "description", "enabled", "pinned", "instance")}),
        ("Weights", {"fields": ("source_kind", "local_path", "hf_repo", "hf_revision")}),
        (
            "Sampling defaults",
            {"fields": ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")},
        ),
        ("Limits", {"fields": ("max_output_tokens", "max_input_tokens")}),
        ("Admission lane", {"fields": ("concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s")}),
        ("Memory", {"fields": ("keep_alive_s",)}),
        ("History", {"fields": ("created_at", "updated_at")}),
    )

    @admin.display(description="instance")
    def instance_id_display(self, obj: ModelAlias) -> str:
        return f"#{obj.instance_id}" if obj.instance_id else "—"

    def save_model(self, request: HttpRequest, obj: ModelAlias, form: forms.ModelForm, change: bool) -> None:
        try:
            services.alias_save(alias=obj)
        except ValidationError as exc:  # the folder changed between clean() and save
            messages.error(request, "; ".join(exc.messages))
            raise


@admin.register(ModelInstance)
class ModelInstanceAdmin(admin.ModelAdmin):
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


class ApiKeyCreateForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ("owner", "name")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "owner", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "owner__username")
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    exclude = ("secret_hash",)
    actions = ("revoke",)

    def get_form(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> type[forms.ModelForm]:
        if obj is None:
            kwargs["form"] = ApiKeyCreateForm
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("owner", "prefix", "created_at", "last_used_at", "revoked_at") if obj else ()

    def save_model(self, request: HttpRequest, obj: ApiKey, form: forms.ModelForm, change: bool) -> None:
        if change:
            obj.save(update_fields=["name", "updated_at"])
            return
        key, raw = services.apikey_create(owner=obj.owner, name=obj.name)
        obj.pk, obj.prefix, obj.secret_hash = key.pk, key.prefix, key.secret_hash
        messages.warning(request, f"New API key (shown once, copy it now): {raw}")

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        for key in queryset.filter(revoked_at__isnull=True):
            services.apikey_revoke(key=key)


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    list_display = ("public_id", "alias_name", "owner", "status", "instance_id", "created_at", "expires_at")
    list_filter = ("status", "alias_name")
    search_fields = ("public_id", "previous_response_id", "output_text")
    readonly_fields = [f.name for f in StoredResponse._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(InstanceTombstone)
class InstanceTombstoneAdmin(admin.ModelAdmin):
    """Read-only: the persist breaker writes these, the tombstone sweep deletes them (REG-7)."""

    list_display = ("instance_id", "source", "revision", "response_public_id", "created_at", "expires_at")
    search_fields = ("response_public_id", "source")
    readonly_fields = [f.name for f in InstanceTombstone._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
