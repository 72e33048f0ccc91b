"""`/ws/dashboard`: the dashboard's live status of every engine (ADM-2)."""

from __future__ import annotations

import contextlib
from typing import Any

from asgiref.sync import sync_to_async
from autobahn.exception import Disconnected

from api.ws import CLOSE_FORBIDDEN, CLOSE_UNAUTHENTICATED
from api.ws.auth import origin_allowed, session_user
from api.ws.tracking import TrackedConsumer
from mlxhost import wire
from models_app.catalogue import control


class DashboardConsumer(TrackedConsumer):
    """`/ws/dashboard`: staff only; pushes every engine's status as it is published (ADM-2)."""

    async def connect(self) -> None:
        user = session_user(self.scope) if origin_allowed(self.scope) else None
        if user is None or not user.is_staff:
            await self.close(code=CLOSE_FORBIDDEN if user is not None else CLOSE_UNAUTHENTICATED)
            return
        await self.channel_layer.group_add(control.DASHBOARD_GROUP, self.channel_name)
        await self.watch_credentials(user_id=user.pk)
        await self.accept()
        for status in await sync_to_async(control.engine_statuses)():
            with contextlib.suppress(Disconnected):  # the page closed already
                await self.send(text_data=wire.dumps({"type": "status", "status": status}))

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(control.DASHBOARD_GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        pass  # the dashboard only listens; actions go through the admin's forms (CSRF)

    async def credentials_revoked(self, message: dict[str, Any]) -> None:
        await super().credentials_revoked(message)
        await self.channel_layer.group_discard(control.DASHBOARD_GROUP, self.channel_name)

    async def dashboard_status(self, message: dict[str, Any]) -> None:
        if self.revoked:
            return  # closed by a logout: not one more status frame
        with contextlib.suppress(Disconnected):  # the page closed before its disconnect arrived
            await self.send(text_data=wire.dumps({"type": "status", "status": message["status"]}))
