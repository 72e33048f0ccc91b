"""The process's open WebSockets, and their close at shutdown (OPS-5).

Every accepted socket is held here until it disconnects; as shutdown begins they are pinned, and
after the drain and the flush each one is closed with 1001 and its ASGI task ended. The two
shutdown hooks (`pin_open_sockets`, `close_sockets_at_stop`) are in `mlxhost.composition.HOOKS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any

from api.ws import CLOSE_GOING_AWAY
from api.ws.auth import CredentialedConsumer
from mlxhost import daphne_options
from mlxhost.runtime import lifecycle

logger = logging.getLogger(__name__)


class TrackedConsumer(CredentialedConsumer):
    """A consumer whose accepted sockets the shutdown closes (see `close_open_sockets`)."""

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        await super().accept(subprotocol, headers)
        self._app_task = asyncio.current_task()  # the ASGI instance that runs this consumer
        _open_sockets.add(self)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        _open_sockets.discard(self)
        await super().websocket_disconnect(message)


_open_sockets: weakref.WeakSet[TrackedConsumer] = weakref.WeakSet()
_pinned_sockets: list[TrackedConsumer] = []


def pin_open_sockets() -> None:
    """Hold every open socket until `close_open_sockets` runs (called as shutdown begins).

    Daphne cancels each consumer's ASGI task as shutdown begins; a consumer that then has
    no running turn is only weakly referenced and vanished before its 1001 went out, so the
    client saw 1006. From here on daphne's cancel no longer stops a consumer
    (`lifecycle.ServeThroughShutdown`).
    """
    _pinned_sockets[:] = list(_open_sockets)


async def close_open_sockets(timeout: float) -> int:
    """Close every open socket with 1001, then end each consumer's ASGI task (OPS-5).

    Runs at shutdown after the drain ended every turn. A consumer still waiting for frames
    when the event loop stops would be finalized with the interpreter, which crashed the
    process at exit (SIGSEGV in a half-torn-down asyncio.Queue). The client's close reply
    may never come while the server stops, so each task is cancelled and awaited (at most
    `timeout`). Returns how many sockets were open.
    """
    sockets = list({*_pinned_sockets, *_open_sockets})
    _pinned_sockets.clear()
    for socket in sockets:
        with contextlib.suppress(Exception):  # a socket that is closing already
            await socket.close(code=CLOSE_GOING_AWAY)
    # The reactor drops connections once the stop hooks return: let the close frames go out and
    # the clients answer them first, or they see 1006 (issue 25).
    if still := await daphne_options.wait_for_closes(timeout):
        logger.warning("%d WebSocket(s) did not finish closing in %.0fs", still, timeout)
    tasks = {t for s in sockets if (t := getattr(s, "_app_task", None)) is not None and not t.done()}
    tasks.discard(asyncio.current_task())
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    _open_sockets.clear()
    return len(sockets)


async def close_sockets_at_stop() -> None:
    """The stop hook: close every open socket after the drain and the flush (OPS-5)."""
    if closed := await close_open_sockets(lifecycle.STOP_GRACE_S):
        logger.info("closed %d open WebSocket(s)", closed)
