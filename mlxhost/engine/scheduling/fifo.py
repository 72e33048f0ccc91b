"""The worker's jobs in arrival order, and the one wait for more of them."""

from __future__ import annotations

import queue
from collections import deque
from typing import TYPE_CHECKING

from mlxhost.engine.jobs import WriteJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.scheduling.base import Queued

# How often a wait for more jobs re-reads the lane's permit count.
POLL_S = 0.005


class Fifo:
    """Jobs put from any thread, taken by the worker thread into `pending` (FIFO order) or, for
    disk-tier saves, into `writes` (off the FIFO, see `WriteJob`).

    `arrivals` is the lane's count of requests still preparing (their permits); `clock` is the
    worker's, the one every wait's deadline is read from.
    """

    def __init__(self, clock: Callable[[], float], arrivals: Callable[[], int]) -> None:
        self.pending: deque[Queued] = deque()  # taken, not yet started
        self.writes: deque[WriteJob] = deque()
        self._inbox: queue.Queue[Queued | WriteJob] = queue.Queue()
        self._clock = clock
        self._arrivals = arrivals

    def put(self, job: Queued | WriteJob) -> None:
        """Any thread: the worker takes `job` in order."""
        self._inbox.put(job)

    @property
    def head(self) -> Queued | None:
        return self.pending[0] if self.pending else None

    def pop(self) -> Queued:
        return self.pending.popleft()

    def count(self, kind: type[object]) -> int:
        """How many pending jobs are of `kind`."""
        return sum(1 for job in self.pending if isinstance(job, kind))

    def inbox_empty(self) -> bool:
        return self._inbox.empty()

    def wait(self) -> None:
        """Block until one job is put, and take it."""
        self._take(self._inbox.get())

    def drain(self) -> None:
        """Take every job put so far, without blocking."""
        while True:
            try:
                self._take(self._inbox.get_nowait())
            except queue.Empty:
                return

    def gather(
        self, wait_s: float, wants_more: Callable[[], bool], on_wait: Callable[[], None] | None = None
    ) -> None:
        """Take jobs as they are put while requests are still preparing and `wants_more()`, for at
        most `wait_s` on the worker's clock; `on_wait` runs before each poll. With no request
        preparing it returns at once: a lone request never waits."""
        deadline = self._clock() + wait_s
        while self._arrivals() > 0 and wants_more():
            left = deadline - self._clock()
            if left <= 0:
                return
            if on_wait is not None:
                on_wait()
            try:
                self._take(self._inbox.get(timeout=min(left, POLL_S)))
            except queue.Empty:
                continue

    def _take(self, job: Queued | WriteJob) -> None:
        if isinstance(job, WriteJob):
            self.writes.append(job)
        else:
            self.pending.append(job)
