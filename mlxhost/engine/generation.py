"""A `Generation`: one admitted request's event stream on the asyncio side, plus its stop flag."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from mlxhost.engine.errors import RequestCancelledError
from mlxhost.engine.types import Done, Event, Failed, Queued

if TYPE_CHECKING:
    from mlxhost.engine.sessions import Outcome
    from mlxhost.engine.types import GenerationRequest


class Generation:
    """Events of one request, bridged from the lane and the worker thread to the event loop.

    Iterate `stream()` to read `Queued` (while waiting), `Started`, `Delta`... then one `Done`
    or `Failed`. HTTP views first await `admitted()`, so queue timeouts and drains become
    proper status codes before any byte is sent. Closing or cancelling either (a client
    disconnect) cancels the request: out of the queue at once, or the worker stops within
    one decode step. Loop-side methods must be called on the engine's loop.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.stop_flag = threading.Event()
        self.finished = False
        self.cancelled = False
        self.session_outcome: Outcome = "fresh"
        self.cached_tokens = 0
        self.instance_id = request.model.instance_id
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._admission: asyncio.Future[None] = loop.create_future()
        self._on_cancel: Callable[[], None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def post(self, event: Event) -> None:
        """Loop side: hand one event to the reader."""
        self._events.put_nowait(event)

    def post_threadsafe(self, event: Event) -> None:
        """Called from the worker thread: hand one event to the loop."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """The engine's hook that takes this request out of its lane when it is cancelled."""
        self._on_cancel = callback

    def admit(self) -> None:
        """The lane let the request in (or it ended while queued): release `admitted()`."""
        if not self._admission.done():
            self._admission.set_result(None)

    def refuse(self, error: Exception) -> None:
        """The request left the queue without running (timeout, drain): `admitted()` raises."""
        if not self._admission.done():
            self._admission.set_exception(error)
            self._admission.exception()  # retrieved here so an unread refusal never warns

    def queued(self, position: int) -> None:
        self.post(Queued(position=position))

    def cancel(self) -> None:
        """Cancel this request wherever it is; idempotent."""
        if self.cancelled or self.finished:
            return
        self.cancelled = True
        self.stop_flag.set()
        if self._on_cancel is not None:
            self._on_cancel()

    async def admitted(self) -> None:
        """Wait until the request leaves the queue.

        Raises:
            QueueTimeoutError: it waited longer than the lane's queue timeout (LANE-8).
            DrainingError: the lane started draining while it waited (LANE-7).
        """
        try:
            await asyncio.shield(self._admission)
        except RequestCancelledError:
            return  # the stream ends with Done(cancelled)
        except asyncio.CancelledError:
            self.cancel()
            raise

    async def stream(self) -> AsyncIterator[Event]:
        """Yield events until the terminal `Done` or `Failed`.

        Yields:
            Queued while waiting, Started, then Delta events, then exactly one Done or Failed.
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
