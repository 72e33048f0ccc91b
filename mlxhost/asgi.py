"""ASGI entry point: `daphne mlxhost.asgi:application` serves HTTP and WebSocket and owns the engine."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import django
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mlxhost.settings")


class QuietDisconnectASGIHandler(ASGIHandler):
    """Django's ASGI handler, whose disconnect listener ends quietly instead of raising.

    `handle()` runs the view and the disconnect listener as tasks of its own and reads their
    results; at shutdown daphne cancels `handle()` itself while a stream still runs (OPS-5), so
    no one reads the listener's `RequestAborted` when the client then goes, and asyncio logged
    "Task exception was never retrieved" with a traceback (issue 25). Returning is the same to
    `handle()`: the listener finished, so the view is cancelled.
    """

    async def listen_for_disconnect(self, receive: Any) -> None:
        with contextlib.suppress(RequestAborted):
            await super().listen_for_disconnect(receive)


django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application does
django_asgi_app = QuietDisconnectASGIHandler()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from api.routing import websocket_urlpatterns  # noqa: E402
from mlxhost.daphne_options import configure_daphne_websockets, configure_status_phrases  # noqa: E402
from mlxhost.runtime import control, persistence, status, usage  # noqa: E402, F401  (they register their hooks)
from mlxhost.runtime.lifecycle import schedule_engine_start  # noqa: E402

# Daphne serves no static files itself; the admin's CSS and the dashboard's JS come from here.
http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.MLXHOST_SERVE_STATIC else django_asgi_app
# WebSocket consumers check Origin and credentials themselves (API-5): API-key clients send no Origin.
application = ProtocolTypeRouter(
    {"http": http_app, "websocket": AuthMiddlewareStack(URLRouter(websocket_urlpatterns))}
)

# Daphne imports this module before it builds its WebSocket factory.
configure_daphne_websockets(max_frame_bytes=settings.MLXHOST_WS_MAX_FRAME_BYTES)
configure_status_phrases()  # 529's status line reads "Overloaded", not "Unknown Status"

# Daphne installs its asyncio reactor before importing this module, so the engine starts on
# the server's own loop as soon as it runs (pinned aliases load; /readyz reports progress).
schedule_engine_start()
