"""Admin pages for stored responses (a preview of each turn, its conversation, its chain, a link
to continue it in the chat page) and the persist breaker's tombstones; read-only."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from models_app.catalogue import selectors
from models_app.models import InstanceTombstone, StoredResponse
from models_app.turns import transcripts

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import QuerySet
    from django.utils.safestring import SafeString

    _StoredResponseAdminBase = admin.ModelAdmin[StoredResponse]
    _InstanceTombstoneAdminBase = admin.ModelAdmin[InstanceTombstone]
else:
    _StoredResponseAdminBase = _InstanceTombstoneAdminBase = admin.ModelAdmin

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
