"""Who a WebSocket is (API-5): the handshake's Origin, its API key or session, and the watch that
closes the socket with 4401 once that key is revoked or that login ends. The key is read as the
REST surfaces read it (`api.auth.presented_key`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from api.ws import CLOSE_UNAUTHENTICATED
from models_app.catalogue import control, selectors

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)


def headers_of(scope: dict[str, Any]) -> dict[str, str]:
    """The handshake's headers by (ASGI's lower-case) name; the first of a repeated one counts."""
    headers: dict[str, str] = {}
    for key, value in scope.get("headers", []):
        headers.setdefault(key.decode("latin1"), value.decode("latin1"))
    return headers


def origin_allowed(scope: dict[str, Any]) -> bool:
    """True when the handshake has no Origin (not a browser) or one of this site.

    "This site" is the Host the browser connected to, or an origin listed in
    MLXHOST_WS_ALLOWED_ORIGINS (for a proxy that rewrites Host).
    """
    headers = headers_of(scope)
    origin = headers.get("origin", "")
    if not origin:
        return True
    allowed = {o.rstrip("/") for o in settings.MLXHOST_WS_ALLOWED_ORIGINS}
    if origin.rstrip("/") in allowed:
        return True
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()


def session_user(scope: dict[str, Any]) -> Any | None:
    """The logged-in, active user of a browser handshake from this site, else None.

    A session cookie counts only with an Origin header: a browser always sends one, and
    `origin_allowed` has checked it is ours (no cross-site WebSocket hijacking).
    """
    user = scope.get("user")
    if user is None or not user.is_authenticated or not user.is_active or not headers_of(scope).get("origin"):
        return None
    return user


class CredentialedConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels ships no types: Any
    """A consumer that watches the key or login it was opened with (`watch_credentials`)."""

    revoked = False  # its key or login ended: closed with 4401, and it serves nothing more
    _credential_check: Callable[[], bool] | None = None

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch, minus its hop to the sync thread before each incoming frame (to
        close stale database connections): in a burst those hops queued on asgiref's one sync
        thread ahead of every refusal (issue 25 §4). A frame's database work, the credential
        check, goes through `database_sync_to_async`, which closes them itself on that thread."""
        if message["type"] == "websocket.receive":
            await self.websocket_receive(message)
        else:
            await super().dispatch(message)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        await self._unwatch_credentials()
        await super().websocket_disconnect(message)

    async def watch_credentials(self, *, key_id: int | None = None, user_id: int | None = None) -> None:
        """Close this socket with 4401 once its key is revoked or its login ends (API-5).

        The revoke and the logout push a message to the credential's group; a periodic
        re-check (MLXHOST_WS_AUTH_RECHECK_S) catches what sends none, such as an expired session.
        """
        session_key = getattr(self.scope.get("session"), "session_key", None)
        if key_id is not None:
            group, check = (
                control.apikey_group(key_id),
                functools.partial(selectors.apikey_is_live, key_id=key_id),
            )
        elif user_id is not None and session_key:
            group = control.session_group(session_key)
            check = functools.partial(selectors.session_is_live, session_key=session_key, user_id=user_id)
        else:
            return
        self._credential_group, self._credential_check = group, check
        await self.channel_layer.group_add(group, self.channel_name)
        self._recheck = asyncio.get_running_loop().create_task(self._recheck_credentials())

    async def credentials_live(self) -> bool:
        """False once the watched key or login has ended (or the socket was told so); True when
        none is watched. Every frame asks first, so a socket whose close message never came (no
        shared channel layer) still cannot start a turn after a logout (API-5)."""
        if self.revoked:
            return False
        check = self._credential_check
        return check is None or bool(await database_sync_to_async(check)())

    async def _recheck_credentials(self) -> None:
        while True:
            await asyncio.sleep(settings.MLXHOST_WS_AUTH_RECHECK_S)
            try:
                live = await self.credentials_live()
            except Exception:  # the database is away for a moment: the next round asks again
                logger.warning("could not re-check a socket's credentials", exc_info=True)
                continue
            if not live:
                await self.credentials_revoked({})
                return

    async def credentials_revoked(self, message: dict[str, Any]) -> None:
        """The `credentials.revoked` group message: the key was revoked or the login ended."""
        if self.revoked:
            return  # the push and a re-check can both get here
        self.revoked = True
        await self.close(code=CLOSE_UNAUTHENTICATED)

    async def _unwatch_credentials(self) -> None:
        if (task := getattr(self, "_recheck", None)) is not None:
            task.cancel()
        if (group := getattr(self, "_credential_group", None)) is not None:
            await self.channel_layer.group_discard(group, self.channel_name)
