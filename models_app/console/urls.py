"""Routes of the staff pages, mounted under /dashboard/ (ADM-2, ADM-7)."""

from __future__ import annotations

from django.urls import path

from models_app.console import views

app_name = "dashboard"

urlpatterns = [
    path("", views.dashboard, name="index"),
    path("chat/", views.chat, name="chat"),
    path("chat/aliases/", views.chat_aliases, name="chat-aliases"),
    path("models/", views.models_page, name="models"),
    path("models/<int:pk>/<str:action>/", views.model_action, name="model-action"),
]
