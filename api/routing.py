"""WebSocket routes (Channels)."""

from __future__ import annotations

from django.urls import path

from api import ws

websocket_urlpatterns = [
    path("ws/v1/responses", ws.ResponsesConsumer.as_asgi()),
    path("ws/dashboard", ws.DashboardConsumer.as_asgi()),
]
