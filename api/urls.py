"""URL routes of the REST surfaces."""

from __future__ import annotations

from django.urls import path

from api import health
from api.openai import views as openai_views

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("v1/chat/completions", openai_views.chat_completions, name="chat-completions"),
    path("v1/models", openai_views.models_list, name="models-list"),
    path("v1/models/<str:name>", openai_views.model_retrieve, name="models-retrieve"),
]
