"""The per-instance admission lane: FIFO readers, exclusive writers, permits, cancel and drain."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

TicketState = Literal["permit", "queued", "active", "done"]

QUEUE_FULL_MESSAGE = "The model's queue is full; retry after the suggested delay."
QUEUE_TIMEOUT_MESSAGE = "The request waited too long in the model's queue."
CANCELLED_MESSAGE = "The request was cancelled."
_EWMA_ALPHA = 0.3
_RETRY_MAX_S = 60


def _resolve(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    # The awaiting task may be gone (cancelled); never touch a finished future.
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _mark_retrieved(future: asyncio.Future[None]) -> None:
    # Outcomes also show in `Ticket.state`; nobody awaiting is fine, so no "never retrieved" noise.
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True, slots=True)
class TicketHooks:
    """What a lane tells a ticket's owner: admitted (a slot is its), a new queue position, and an
    abort (a drain ran out of time, LANE-7). Handed in with the permit by `Lane.enter`."""

    on_admit: Callable[[Ticket], None] | None = None
    on_position: Callable[[int], None] | None = None
    on_abort: Callable[[], None] | None = None


NO_HOOKS = TicketHooks()


class Ticket:
    """One request's place in a lane: a permit, then queued or active, then done."""

    def __init__(self, request_id: str, admitted: asyncio.Future[None]) -> None:
        self.request_id = request_id
        self.state: TicketState = "permit"
        self.position = 0
        self.admitted = admitted
        self.hooks = NO_HOOKS
        self.cancelled = False
        self._timer: asyncio.TimerHandle | None = None
        self._admitted_at = 0.0
        self._aborted = False
        admitted.add_done_callback(_mark_retrieved)

    def __repr__(self) -> str:
        return f"Ticket({self.request_id!r}, state={self.state!r}, position={self.position})"


class _Writer:
    def __init__(self, admitted: asyncio.Future[None]) -> None:
        self.admitted = admitted
        self.state: TicketState = "queued"
        admitted.add_done_callback(_mark_retrieved)


@dataclass(frozen=True, slots=True)
class LaneProbe:
    """A snapshot of one lane's counters (LANE-9)."""

    active: int
    queued: int
    permits: int
    writers: int
    capacity: int
    limit: int | None
    saturated: bool
    draining: bool

    def as_dict(self) -> dict[str, int | bool | None]:
        return asdict(self)


class Lane:
    """Admission for one instance: capacity 1 is a FIFO mutex, capacity N a FIFO counting semaphore."""

    def __init__(
        self,
        *,
        capacity: int = 1,
        queue_depth: int = 16,
        unbounded: bool = False,
        queue_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._live: dict[str, Ticket] = {}
        self._active: dict[str, Ticket] = {}
        self._queue: deque[Ticket | _Writer] = deque()
        self._writer_running = False
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._ewma = 1.0
        self._permits = 0
        self.configure(
            capacity=capacity, queue_depth=queue_depth, unbounded=unbounded, queue_timeout_s=queue_timeout_s
        )

    def configure(
        self, *, capacity: int, queue_depth: int, unbounded: bool, queue_timeout_s: float | None
    ) -> None:
        """Change the limits in place; they apply to the next arrivals (a larger capacity admits waiters)."""
        if capacity < 1 or queue_depth < 0:
            raise ValueError("capacity must be >= 1 and queue_depth >= 0.")
        if queue_timeout_s is not None and queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be positive or None.")
        self.capacity = capacity
        self.queue_depth = queue_depth
        self.unbounded = unbounded
        self.queue_timeout_s = queue_timeout_s
        self._pump()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return sum(1 for entry in self._queue if isinstance(entry, Ticket))

    @property
    def permits(self) -> int:
        """Requests holding a permit: reserved, still loading or templating, not yet entered.

        A plain counter, so the instance's worker thread may read it (a burst about to arrive).
        """
        return self._permits

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def limit(self) -> int | None:
        return None if self.unbounded else self.capacity + self.queue_depth

    def reserve(self, request_id: str) -> Ticket:
        """Take a permit for `request_id` (LANE-2, LANE-3, LANE-5); call this inside the event loop.

        Raises:
            DrainingError: the lane is draining.
            DuplicateRequestError: the id is already permitted, queued or active.
            QueueFullError: active + queued + permits is at the budget (carries `retry_after`).
        """
        if self._draining:
            raise DrainingError()
        if request_id in self._live:
            raise DuplicateRequestError(f"Request id {request_id!r} is already in use.")
        self.refuse_if_full()
        ticket = Ticket(request_id, asyncio.get_running_loop().create_future())
        self._live[request_id] = ticket
        self._permits += 1
        return ticket

    def refuse_if_full(self) -> None:
        """Raise what `reserve` would raise for a new request now; take nothing (LANE-2).

        Raises:
            DrainingError: the lane is draining.
            QueueFullError: active + queued + permits is at the budget (carries `retry_after`).
        """
        if self._draining:
            raise DrainingError()
        if self._over_budget():
            raise QueueFullError(QUEUE_FULL_MESSAGE, retry_after=self._retry_after())

    def enter(self, ticket: Ticket, hooks: TicketHooks = NO_HOOKS) -> None:
        """Hand a permit into the lane with its `hooks`: active at once, or queued behind earlier
        waiters.

        Raises:
            RuntimeError: the ticket was already entered or released.
            DrainingError: the lane is draining (the permit is released).
            RequestCancelledError: the permit was cancelled (the permit is released).
        """
        if ticket.state != "permit" or self._live.get(ticket.request_id) is not ticket:
            raise RuntimeError(f"{ticket!r} is not an outstanding permit of this lane.")
        ticket.hooks = hooks
        if self._draining:
            self.release(ticket)
            raise DrainingError()
        if ticket.cancelled:
            self.release(ticket)
            raise RequestCancelledError(CANCELLED_MESSAGE)
        if len(self._active) < self.capacity and not self._queue and not self._writer_running:
            self._activate(ticket)
        else:
            self._enqueue(ticket)

    def release(self, ticket: Ticket) -> None:
        """Give back whatever `ticket` holds; idempotent, and the id stops being live."""
        if ticket.state == "done":
            return
        if ticket.state == "queued":
            self._queue.remove(ticket)
        elif ticket.state == "active":
            del self._active[ticket.request_id]
            elapsed = max(0.0, self._clock() - ticket._admitted_at)
            self._ewma += _EWMA_ALPHA * (elapsed - self._ewma)
        self._retire(ticket)
        # Nobody should still await a released ticket; cancelling wakes a stray waiter.
        ticket.admitted.cancel()
        self._pump()

    def cancel(self, request_id: str) -> bool:
        """Cancel by id (LANE-6); returns False when the id is not live.

        A permit is marked so `enter` raises; a queued ticket leaves with `RequestCancelledError`;
        an active ticket gets `on_abort()` once and keeps its slot until `release()`.
        """
        ticket = self._live.get(request_id)
        if ticket is None:
            return False
        ticket.cancelled = True
        if ticket.state == "queued":
            self._drop_queued(ticket)
            _resolve(ticket.admitted, RequestCancelledError(CANCELLED_MESSAGE))
            self._pump()
        elif ticket.state == "active":
            self._abort(ticket)
        return True

    @asynccontextmanager
    async def exclusive(self, *, abort_after: float | None = None) -> AsyncIterator[None]:
        """Run the block as a writer (LANE-4): alone in the lane, after every earlier waiter.

        Requests arriving meanwhile queue behind the writer and run after it. With `abort_after`
        (an in-place reload), a writer still waiting after that many seconds moves to the head of
        the queue and aborts what runs (LANE-7's drain timeout); nothing waiting is refused.

        Raises:
            DrainingError: the lane is draining, or starts draining while the writer waits.
        """
        if self._draining:
            raise DrainingError()
        writer = _Writer(asyncio.get_running_loop().create_future())
        self._queue.append(writer)
        self._pump()
        try:
            if abort_after is not None and not writer.admitted.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer.admitted), abort_after)
                if writer.state == "queued":
                    self._queue.remove(writer)
                    self._queue.appendleft(writer)
                    self._abort_active()
                    self._pump()
            await writer.admitted
        except BaseException:
            self._abandon(writer)
            raise
        try:
            yield
        finally:
            self._abandon(writer)

    async def drain(self, mode: Literal["wait", "abort"] = "wait", timeout: float | None = None) -> None:
        """Refuse new work, fail every waiter with `DrainingError`, and return once nothing runs (LANE-7).

        Args:
            mode: "abort" calls `on_abort()` on every active ticket now; "wait" lets them finish.
            timeout: with "wait", abort whatever still runs after this many seconds.
        """
        if mode not in ("wait", "abort"):
            raise ValueError(f"Unknown drain mode {mode!r}.")
        self._draining = True
        self._fail_waiters()
        if mode == "abort":
            self._abort_active()
        elif timeout is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                self._abort_active()
        await self._idle.wait()

    def reopen(self) -> None:
        """Accept work again after a drain."""
        self._draining = False

    def probe(self) -> LaneProbe:
        """Report the lane's counters (LANE-9); `saturated` means a `reserve()` now would be refused."""
        writers = sum(1 for entry in self._queue if isinstance(entry, _Writer)) + self._writer_running
        return LaneProbe(
            active=self.active,
            queued=self.queued,
            permits=self.permits,
            writers=writers,
            capacity=self.capacity,
            limit=self.limit,
            saturated=self._draining or self._over_budget(),
            draining=self._draining,
        )

    def _over_budget(self) -> bool:
        # _live holds every permit, queued and active ticket: exactly the LANE-2 budget.
        return not self.unbounded and len(self._live) >= self.capacity + self.queue_depth

    def _retry_after(self) -> int:
        estimate = math.ceil(self._ewma * (self.queued + 1) / self.capacity)
        return min(max(estimate, 1), _RETRY_MAX_S)

    def _leave_permit(self, ticket: Ticket) -> None:
        if ticket.state == "permit":
            self._permits -= 1

    def _enqueue(self, ticket: Ticket) -> None:
        self._leave_permit(ticket)
        self._queue.append(ticket)
        ticket.state = "queued"
        ticket.position = self.queued
        if self.queue_timeout_s is not None:
            loop = asyncio.get_running_loop()
            ticket._timer = loop.call_later(self.queue_timeout_s, self._expire, ticket)
        if ticket.hooks.on_position is not None:
            ticket.hooks.on_position(ticket.position)

    def _activate(self, ticket: Ticket) -> None:
        self._leave_permit(ticket)
        self._stop_timer(ticket)
        ticket.state = "active"
        ticket.position = 0
        ticket._admitted_at = self._clock()
        self._active[ticket.request_id] = ticket
        self._idle.clear()
        if ticket.hooks.on_admit is not None:
            ticket.hooks.on_admit(ticket)
        _resolve(ticket.admitted)

    def _drop_queued(self, ticket: Ticket) -> None:
        self._queue.remove(ticket)
        self._retire(ticket)

    def _retire(self, ticket: Ticket) -> None:
        self._leave_permit(ticket)
        self._stop_timer(ticket)
        ticket.state = "done"
        ticket.position = 0
        if self._live.get(ticket.request_id) is ticket:
            del self._live[ticket.request_id]

    @staticmethod
    def _stop_timer(ticket: Ticket) -> None:
        if ticket._timer is not None:
            ticket._timer.cancel()
            ticket._timer = None

    def _expire(self, ticket: Ticket) -> None:
        ticket._timer = None
        if ticket.state != "queued":
            return
        self._drop_queued(ticket)
        _resolve(ticket.admitted, QueueTimeoutError(QUEUE_TIMEOUT_MESSAGE, retry_after=self._retry_after()))
        self._pump()

    def _pump(self) -> None:
        """Admit waiters from the head of the FIFO while they fit, then renumber the rest."""
        while self._queue and not self._writer_running:
            head = self._queue[0]
            if isinstance(head, _Writer):
                if head.admitted.done():  # its task was cancelled while it waited
                    self._queue.popleft()
                    head.state = "done"
                    continue
                if self._active:
                    break
                self._queue.popleft()
                head.state = "active"
                self._writer_running = True
                _resolve(head.admitted)
            elif len(self._active) < self.capacity:
                self._queue.popleft()
                self._activate(head)
            else:
                break
        self._renumber()
        self._sync_idle()

    def _renumber(self) -> None:
        position = 0
        for entry in self._queue:
            if isinstance(entry, Ticket):
                position += 1
                if entry.position != position:
                    entry.position = position
                    if entry.hooks.on_position is not None:
                        entry.hooks.on_position(position)

    def _sync_idle(self) -> None:
        if self._active or self._writer_running:
            self._idle.clear()
        else:
            self._idle.set()

    def _abandon(self, writer: _Writer) -> None:
        if writer.state == "queued":
            self._queue.remove(writer)
        elif writer.state == "active":
            self._writer_running = False
        writer.state = "done"
        self._pump()

    def _abort(self, ticket: Ticket) -> None:
        if ticket._aborted:
            return
        ticket._aborted = True
        if ticket.hooks.on_abort is not None:
            ticket.hooks.on_abort()

    def _abort_active(self) -> None:
        for ticket in list(self._active.values()):
            self._abort(ticket)

    def _fail_waiters(self) -> None:
        while self._queue:
            entry = self._queue.popleft()
            if isinstance(entry, Ticket):
                self._retire(entry)
            entry.state = "done"
            _resolve(entry.admitted, DrainingError())
        self._sync_idle()
