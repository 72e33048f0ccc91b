"""WebSocket routes (Channels)."""

from __future__ import annotations

from django.urls import path

from api import consumers

websocket_urlpatterns = [
    path("ws/v1/responses", consumers.ResponsesConsumer.as_asgi()),
    path("ws/dashboard", consumers.DashboardConsumer.as_asgi()),
]
