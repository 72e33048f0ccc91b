"""WebSocket routes (Channels)."""

from __future__ import annotations

from django.urls import path, re_path

from api import consumers

websocket_urlpatterns = [
    path("ws/v1/responses", consumers.ResponsesConsumer.as_asgi()),
    path("ws/dashboard", consumers.DashboardConsumer.as_asgi()),
    # Last: an upgrade to any other path is refused (daphne's 403), not a 500 from Channels'
    # "No route found" with a traceback in the log.
    re_path(r"", consumers.NoRouteConsumer.as_asgi()),
]
