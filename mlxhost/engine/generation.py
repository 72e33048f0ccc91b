"""A `Generation`: one admitted request's event stream on the asyncio side, plus its stop flag."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING

from mlxhost.engine.errors import RequestCancelledError
from mlxhost.engine.types import Delta, Done, Event, Failed, Queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from mlxhost.engine.answer import AnswerReader
    from mlxhost.engine.sessions import Outcome
    from mlxhost.engine.types import GenerationRequest, TokenLogprob

logger = logging.getLogger(__name__)


class _DeltaRun:
    """Consecutive undelivered Deltas, joined into one when the reader takes it (coalescing)."""

    __slots__ = ("first", "ids", "logprobs", "texts")

    def __init__(self, delta: Delta) -> None:
        self.first = delta
        self.texts: list[str] | None = None
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []

    def add(self, delta: Delta) -> None:
        if self.texts is None:
            self.texts = [self.first.text]
            self.ids.extend(self.first.token_ids)
            self.logprobs.extend(self.first.logprobs)
        self.texts.append(delta.text)
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)

    def build(self) -> Delta:
        if self.texts is None:
            return self.first
        return Delta("".join(self.texts), tuple(self.ids), tuple(self.logprobs))


class _Courier:
    """Carries worker-thread events to one loop: one scheduled callback per burst, for all requests.

    A batch step posts a token to every sequence's generation at once; they share one loop
    wake-up instead of one `call_soon_threadsafe` each. Per generation, order is kept.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parcels: deque[tuple[Generation, Event]] = deque()
        self._scheduled = False

    def send(self, generation: Generation, event: Event) -> None:
        # No lock: deque appends and pops are atomic. Senders append before they read the flag
        # and `_deliver` clears it before it drains, so a parcel is never left without a delivery.
        self._parcels.append((generation, event))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False
        parcels = self._parcels
        while parcels:
            generation, event = parcels.popleft()
            generation.post(event)


_couriers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Courier] = weakref.WeakKeyDictionary()


def _courier_for(loop: asyncio.AbstractEventLoop) -> _Courier:
    # Generations are created on their loop's thread, so this lookup needs no lock.
    try:
        courier = _couriers.get(loop)
        if courier is None:
            courier = _couriers[loop] = _Courier(loop)
    except TypeError:  # a loop type without weak references: a courier of its own
        courier = _Courier(loop)
    return courier


class Generation:
    """Events of one request, bridged from the lane and the worker thread to the event loop.

    Iterate `stream()` to read `Queued` (while waiting), `Started`, `Delta`... then one `Done`
    or `Failed`. HTTP views first await `admitted()`, so queue timeouts and drains become
    proper status codes before any byte is sent. Closing or cancelling either (a client
    disconnect) cancels the request: out of the queue at once, or the worker stops within
    one decode step. Loop-side methods must be called on the engine's loop.

    Deltas coalesce: events from worker threads are buffered and handed to the loop by one
    scheduled callback per burst (shared by every generation on the loop), and a Delta posted
    while an earlier one is still unread is merged into it (texts joined, token ids
    concatenated, order kept). A slow reader thus gets fewer, larger Deltas, and the loop
    does not wake once per token.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.stop_flag = threading.Event()
        self.finished = False
        self.cancelled = False
        self.result: Done | Failed | None = None  # the terminal event, once the reader had it
        self.session_outcome: Outcome = "fresh"
        self.cached_tokens = 0
        self.instance_id = 0  # set by the engine once the binding is resolved
        # Reads tool calls and reasoning out of the answer text (set by the engine; None: plain).
        self.reader: AnswerReader | None = None
        self._loop = loop
        self._events: deque[Event | _DeltaRun] = deque()  # loop side, unread
        self._wakeup: asyncio.Future[None] | None = None  # the reader waits on it when empty
        self._courier = _courier_for(loop)
        self._admission: asyncio.Future[None] = loop.create_future()
        self._on_cancel: Callable[[], object] | None = None
        self.terminal: Done | Failed | None = None  # the terminal event, once posted
        self._end_listeners: list[Callable[[Done | Failed], None]] = []
        self._ender: Callable[[Done | Failed], None] | None = None  # its turn's end (turn.Turn)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def add_end_listener(self, listener: Callable[[Done | Failed], None]) -> None:
        """Call `listener(event)` once, on the loop, with the terminal `Done` or `Failed` as it is
        posted, whether or not anyone reads the stream (usage accounting); at once if it was."""
        if self.terminal is not None:
            self._notify(listener, self.terminal)
        else:
            self._end_listeners.append(listener)

    @staticmethod
    def _notify(listener: Callable[[Done | Failed], None], event: Done | Failed) -> None:
        try:
            listener(event)
        except Exception:  # a listener's bug must never stop the answer
            logger.exception("end listener %r failed", listener)

    def end_through(self, ender: Callable[[Done | Failed], None] | None) -> None:
        """Hand terminal events posted here to `ender` (the engine's `Turn`), which ends the turn
        in order, then clears it and posts the event again (None: post terminal events as given)."""
        self._ender = ender

    def post(self, event: Event) -> None:
        """Loop side: hand one event to the reader; a Delta joins an unread Delta at the tail.
        A terminal event goes to the turn that owns this generation first, when one does."""
        if isinstance(event, Done | Failed):
            if self._ender is not None:
                self._ender(event)
                return
            if self.terminal is None:
                self.terminal = event
                listeners, self._end_listeners = self._end_listeners, []
                for listener in listeners:
                    self._notify(listener, event)
        events = self._events
        if isinstance(event, Delta):
            if events and isinstance(events[-1], _DeltaRun):
                events[-1].add(event)
                return  # the reader was already woken for the run
            events.append(_DeltaRun(event))
        else:
            events.append(event)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def post_threadsafe(self, event: Event) -> None:
        """Called from a worker thread: hand one event to the loop (batched per burst)."""
        self._courier.send(self, event)

    def on_cancel(self, callback: Callable[[], object]) -> None:
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

    async def queue_positions(self) -> AsyncIterator[int]:
        """Yield the queue position each time it changes, until the request is admitted.

        For clients that show the wait (the WebSocket surface); HTTP views just await
        `admitted()`. The positions are taken off the stream, so `stream()` starts after them.

        Raises:
            QueueTimeoutError, DrainingError: as `admitted()`.
        """
        while not self._admission.done():
            while self._events and isinstance(head := self._events[0], Queued):
                self._events.popleft()
                yield head.position
            if self._admission.done():
                break
            self._wakeup = self._loop.create_future()
            await asyncio.wait({self._wakeup, self._admission}, return_when=asyncio.FIRST_COMPLETED)
        await self.admitted()

    async def stream(self) -> AsyncIterator[Event]:
        """Yield events until the terminal `Done` or `Failed`.

        Yields:
            Queued while waiting, Started, then Delta events (with a reader, also ReasoningDelta
            and ToolCallDelta), then exactly one Done or Failed.
        """
        try:
            while True:
                event = await self._next_event()
                if isinstance(event, Done | Failed):
                    self.finished = True
                    self.result = event
                reader = self.reader
                if reader is not None and isinstance(event, Delta | Done):
                    for part in reader.feed(event) if isinstance(event, Delta) else reader.finish(event):
                        yield part
                else:
                    yield event
                if self.finished:
                    return
        finally:
            # Reached on a clean end too; cancel() is a no-op for a finished generation.
            if not self.finished:
                self.cancel()

    async def _next_event(self) -> Event:
        while not self._events:
            self._wakeup = self._loop.create_future()
            await self._wakeup
        item = self._events.popleft()
        return item.build() if isinstance(item, _DeltaRun) else item
