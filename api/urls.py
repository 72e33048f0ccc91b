"""URL routes of the REST surfaces."""

from __future__ import annotations

from django.urls import path, re_path, register_converter

from api import errors, health, metrics, openapi
from api.anthropic import views as anthropic_views
from api.openai import completions, embeddings, responses_views
from api.openai import views as openai_views


class PublicIdConverter:
    """A stored response's id as minted (`resp_` + hex), or anything of that alphabet: any other
    text (a NUL byte, which PostgreSQL refuses) never reaches a query and gets the JSON 404."""

    regex = "[A-Za-z0-9_-]{1,64}"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(PublicIdConverter, "public_id")

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
    path("v1/openapi.json", openapi.openapi_json, name="openapi"),
    path("v1/chat/completions", openai_views.chat_completions, name="chat-completions"),
    path("v1/completions", completions.completions, name="completions"),
    path("v1/responses", responses_views.responses_create, name="responses-create"),
    path("v1/responses/<public_id:public_id>", responses_views.response_detail, name="responses-detail"),
    path(
        "v1/responses/<public_id:public_id>/cancel", responses_views.response_cancel, name="responses-cancel"
    ),
    path(
        "v1/responses/<public_id:public_id>/input_items",
        responses_views.response_input_items,
        name="responses-input-items",
    ),
    path("v1/embeddings", embeddings.embeddings, name="embeddings"),
    path("v1/messages", anthropic_views.messages, name="messages"),
    path("v1/messages/count_tokens", anthropic_views.count_tokens, name="messages-count-tokens"),
    path("v1/models", openai_views.models_list, name="models-list"),
    path("v1/models/<slug:name>", openai_views.model_retrieve, name="models-retrieve"),
    # Last: any other path under v1/ is a JSON 404 in the caller's envelope, also with DEBUG on;
    # so is a bare `/v1` (otherwise APPEND_SLASH answers a POST with an empty 301).
    re_path(r"^v1(/|$)", errors.unknown_route, name="unknown-route"),
]
