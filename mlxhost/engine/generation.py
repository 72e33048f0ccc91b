"""A `Generation`: one admitted request's event stream on the asyncio side, plus its stop flag."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from mlxhost.engine.types import Done, Event, Failed

if TYPE_CHECKING:
    from mlxhost.engine.types import GenerationRequest


class Generation:
    """Events of one request, bridged from the worker thread to the event loop.

    Iterate `stream()` to read `Started`, `Delta`... then one `Done` or `Failed`.
    Closing or cancelling the iteration (a client disconnect) sets the stop flag, which
    the worker checks on every token, so the model stops within one decode step.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.stop_flag = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def post_threadsafe(self, event: Event) -> None:
        """Called from the worker thread: hand one event to the loop."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def cancel(self) -> None:
        """Ask the worker to stop; idempotent and safe from any thread."""
        self.stop_flag.set()

    async def stream(self) -> AsyncIterator[Event]:
        """Yield events until the terminal `Done` or `Failed`.

        Yields:
            Started, then Delta events, then exactly one Done or Failed.
        """
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, Done | Failed):
                    self.finished = True
                yield event
                if self.finished:
                    return
        finally:
            # Reached on a clean end too; cancel() is a no-op for a finished generation.
            if not self.finished:
                self.cancel()
