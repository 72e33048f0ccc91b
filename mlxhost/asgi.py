"""ASGI entry point: `daphne mlxhost.asgi:application` serves HTTP and WebSocket and owns the engine."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mlxhost.settings")

from mlxhost.handlers import get_asgi_application

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from api.routing import websocket_urlpatterns  # noqa: E402
from mlxhost import composition  # noqa: E402
from mlxhost.daphne_options import configure_daphne_websockets, configure_status_phrases  # noqa: E402
from mlxhost.runtime.lifecycle import ServeThroughShutdown, schedule_engine_start  # noqa: E402

# Daphne serves no static files itself; the admin's CSS and the dashboard's JS come from here.
http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.MLXHOST_SERVE_STATIC else django_asgi_app
# WebSocket consumers check Origin and credentials themselves (API-5): API-key clients send no Origin.
websocket_app = AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
# A client that leaves while the server drains still cancels its turns, over HTTP or a WebSocket
# (lifecycle.ServeThroughShutdown).
application = ServeThroughShutdown(ProtocolTypeRouter({"http": http_app, "websocket": websocket_app}))

# Daphne imports this module before it builds its WebSocket factory.
configure_daphne_websockets(max_frame_bytes=settings.MLXHOST_WS_MAX_FRAME_BYTES)
configure_status_phrases()  # 529's status line reads "Overloaded", not "Unknown Status"

# Daphne installs its asyncio reactor before importing this module, so the engine starts on
# the server's own loop as soon as it runs (pinned aliases load; /readyz reports progress), with
# every hook of the one list in `mlxhost.composition`.
composition.install()
schedule_engine_start()
