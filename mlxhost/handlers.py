"""The project's ASGI handler: API requests run their sync calls without a thread of their own,
and a client that leaves during shutdown is no traceback."""

from __future__ import annotations

import contextlib
from typing import Any

import django
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler


class ApiASGIHandler(ASGIHandler):
    """Django's handler, minus the per-request `ThreadSensitiveContext` for paths under /v1/.

    Django enters a fresh context for every request, so the request's first thread-sensitive
    `sync_to_async` (the `request_started` receivers) starts a thread, and its end starts
    another to join it: two thread starts per request on the event loop (issue 25 §4, about
    2 ms each on a busy 2-core host, more than the rest of a refusal). API requests keep their
    sync work small (cached lookups, one write at most, the signals), so they share asgiref's
    process-wide sync thread, as WebSocket consumers already do. Admin and page requests keep
    Django's own behaviour.
    """

    def __init__(self) -> None:
        super().__init__()
        from mlxhost.middleware import API_PREFIX  # imports Django's auth: only once it is set up

        self.api_prefix = API_PREFIX

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.api_prefix):
            await self.handle(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def listen_for_disconnect(self, receive: Any) -> None:
        """Django's disconnect listener, ending quietly instead of raising.

        `handle()` runs the view and the disconnect listener as tasks of its own and reads their
        results; at shutdown daphne cancels `handle()` itself while a stream still runs (OPS-5), so
        no one reads the listener's `RequestAborted` when the client then goes, and asyncio logged
        "Task exception was never retrieved" with a traceback (issue 25). Returning is the same to
        `handle()`: the listener finished, so the view is cancelled.
        """
        with contextlib.suppress(RequestAborted):
            await super().listen_for_disconnect(receive)


def get_asgi_application() -> ApiASGIHandler:
    """`django.core.asgi.get_asgi_application`, with the handler above."""
    django.setup(set_prefix=False)
    return ApiASGIHandler()
