"""WebSocket routes (Channels)."""

from __future__ import annotations

from django.urls import path, re_path

from api import consumers

websocket_urlpatterns = [
    path("ws/v1/responses", consumers.ResponsesConsumer.as_asgi()),
    path("ws/dashboard", consumers.DashboardConsumer.as_asgi()),
    # Anything else is refused at the handshake (HTTP 403), not a "No route found" traceback.
    re_path(r"", consumers.UnknownRouteConsumer.as_asgi()),
]
