"""Routes of the staff pages, mounted under /dashboard/ (ADM-2, ADM-4)."""

from __future__ import annotations

from django.urls import path

from models_app import views

app_name = "dashboard"

urlpatterns = [
    path("", views.dashboard, name="index"),
    path("chat/", views.chat, name="chat"),
]
