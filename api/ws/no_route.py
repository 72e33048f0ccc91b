"""The catch-all WebSocket route: a path no route serves is refused with 4404."""

from __future__ import annotations

from channels.generic.websocket import AsyncWebsocketConsumer

from api.ws import CLOSE_NOT_FOUND


class NoRouteConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels ships no types
    """Any WebSocket path without a route: the handshake is refused (daphne answers 403). Channels
    raised "No route found", which daphne logged with a traceback (issue 25)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)
