"""WebSocket routes (Channels)."""

from __future__ import annotations

from django.urls import path, re_path

from api.ws.dashboard import DashboardConsumer
from api.ws.no_route import NoRouteConsumer
from api.ws.responses import ResponsesConsumer

websocket_urlpatterns = [
    path("ws/v1/responses", ResponsesConsumer.as_asgi()),
    path("ws/dashboard", DashboardConsumer.as_asgi()),
    # Last: an upgrade to any other path is refused (daphne's 403), not a 500 from Channels'
    # "No route found" with a traceback in the log.
    re_path(r"", NoRouteConsumer.as_asgi()),
]
