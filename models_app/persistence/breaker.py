"""The write-behind store's pending table, its monitor and breaker, and the embedded sweeper.

`PendingWrites` is the part of `Persistence` that watches writes once they are handed off: the
monitor settles those whose rows landed and trips the breaker on those overdue (PER-4, REG-7),
watches the given-up ones for a late landing (issue 25), and without a broker runs the periodic
cleanups (PER-5). Everything but the database pool runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from models_app.catalogue import selectors, services
from models_app.persistence.records import (
    LANDED_CHUNK,
    LATE_POLL_MAX_S,
    STAT_KEYS,
    Late,
    Pending,
    StoreWiring,
    T,
    call_logged,
    logged,
    running_here,
    with_db,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.runtime.config import PersistenceSettings

logger = logging.getLogger(__name__)


class PendingWrites:
    """The writes this process handed off and has not seen land, and what watches them."""

    def __init__(self, config: PersistenceSettings, wiring: StoreWiring) -> None:
        self.config = config
        self.publish_timeout_s = config.publish_timeout_s
        self.hard_timeout_s = config.hard_timeout_s
        self.wait_s = config.wait_s
        self.poll_s = config.poll_s
        self.tombstone_ttl_s = config.tombstone_ttl_s
        self.sweep_interval_s = config.sweep_interval_s
        self.late_limit = wiring.late_limit
        self._eager = wiring.eager
        self._shared = wiring.shared
        self._clock = wiring.clock
        self._pending: dict[str, Pending] = {}
        self._late: dict[str, Late] = {}  # oldest trip first
        self._stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)
        self._stats["lag_s_sum"] = 0.0
        self._stats["lag_s_max"] = 0.0
        self._db_pool = ThreadPoolExecutor(4, thread_name_prefix="mlxhost-persist-db")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._query: asyncio.Future[set[str]] | None = None

    def _lookup(self, public_id: str) -> Pending | Late | None:
        return self._pending.get(public_id) or self._late.get(public_id)

    def is_pending(self, public_id: str) -> bool:
        """Whether this process is still writing `public_id` (any owner; never show it to clients)."""
        return self._lookup(public_id) is not None

    def pending_count(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics: published, inline_writes, landed, breaker_trips, publish_failures…"""
        return {**self._stats, "pending": len(self._pending), "late": len(self._late)}

    def oldest_pending_s(self) -> float:
        """Seconds the oldest write still pending has waited (0 when none): the persist lag now."""
        if not self._pending:
            return 0.0
        return max(0.0, self._clock() - min(entry.recorded_at for entry in self._pending.values()))

    # Monitor and breaker -------------------------------------------------------------------

    async def run_monitor(self) -> None:
        """Watch pending writes: settle the landed, trip the breaker on the overdue (PER-4).

        Runs until cancelled; returns at once when a monitor already runs on this loop (`record`
        starts one lazily when none does).
        """
        if running_here(self._monitor):
            return
        self._wake, self._query = asyncio.Event(), None
        self._monitor = asyncio.current_task()
        await self._watch()

    def _ensure_monitor(self, loop: asyncio.AbstractEventLoop) -> None:
        if not running_here(self._monitor):
            self._wake, self._query = asyncio.Event(), None
            self._monitor = loop.create_task(self._watch(), name="persist-monitor")
        elif self._wake is not None:
            self._wake.set()
        if self._is_eager() and not running_here(self._sweeper):
            self._sweeper = loop.create_task(self.run_sweeper(), name="persist-sweeper")

    async def _watch(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            if not self._pending and not self._late:
                wake.clear()
                await wake.wait()
                continue
            await asyncio.sleep(self.poll_s)
            try:
                await self._tick()
            except Exception:  # never let one bad tick stop the breaker
                logger.exception("persist monitor tick failed")

    async def _tick(self) -> None:
        if self._query is None and (ids := [*self._pending, *self._late_due()]):
            self._query = asyncio.ensure_future(self._in_db_thread(self._landed_among, ids))
        if self._query is not None:
            # Bounded: a wedged database must not stop the breaker; the query is collected later.
            done, _ = await asyncio.wait({self._query}, timeout=self.poll_s)
            if done:
                query, self._query = self._query, None
                if query.exception() is not None:
                    logger.warning("persist monitor query failed: %s", query.exception())
                else:
                    for public_id in query.result():
                        self._landed(public_id)
        self._check_deadlines()

    def _late_due(self) -> list[str]:
        """The given-up writes to look for now; each is next looked for after twice the wait."""
        now, due = self._clock(), []
        for public_id, late in self._late.items():
            if now >= late.next_check_at:
                due.append(public_id)
                late.interval_s = min(2 * late.interval_s, LATE_POLL_MAX_S)
                late.next_check_at = now + late.interval_s
        return due

    @staticmethod
    def _landed_among(ids: list[str]) -> set[str]:
        landed: set[str] = set()
        for start in range(0, len(ids), LANDED_CHUNK):
            landed |= selectors.responses_landed(public_ids=ids[start : start + LANDED_CHUNK])
        return landed

    def _check_deadlines(self) -> None:
        now = self._clock()
        for entry in [e for e in self._pending.values() if now >= e.deadline]:
            self._trip(entry, now)
        for public_id in [k for k, e in self._late.items() if now >= e.expires_at]:
            self._give_up_late(public_id)

    def _give_up_late(self, public_id: str) -> None:
        late = self._late.pop(public_id)
        self._stats["tombstones_expired"] += 1
        logger.warning("gave up on the late row of response %s", public_id)
        call_logged(late.on_late_landing, "on_late_landing")

    def _trip(self, entry: Pending, now: float) -> None:
        record = entry.record
        del self._pending[record.public_id]
        self._late[record.public_id] = Late(
            owner_id=record.owner_id,
            expires_at=now + self.tombstone_ttl_s,
            on_late_landing=entry.on_late_landing,
            landed=entry.landed,
            next_check_at=now + self.poll_s,
            interval_s=self.poll_s,
        )
        while len(self._late) > self.late_limit:
            self._give_up_late(next(iter(self._late)))
        self._stats["breaker_trips"] += 1
        logger.error(
            "persist of response %s still pending after %.1fs: releasing instance %s (tombstone)",
            record.public_id,
            now - entry.recorded_at,
            record.instance_id,
        )
        call_logged(entry.on_force_release, "on_force_release")
        write = self._in_db_thread(
            services.tombstone_record,
            instance_id=record.instance_id,
            weights_key=record.weights_key,
            public_id=record.public_id,
        )
        self._spawn(asyncio.get_running_loop(), logged(write, f"tombstone for {record.public_id}"))

    def _landed(self, public_id: str) -> None:
        entry = self._pending.pop(public_id, None)
        if entry is not None:
            lag = self._clock() - entry.recorded_at
            self._stats["landed"] += 1
            self._stats["lag_s_sum"] += lag
            self._stats["lag_s_max"] = max(self._stats["lag_s_max"], lag)
            entry.landed.set()
            call_logged(entry.on_settled, "on_settled")
            if self._shared is not None:
                removal = self._in_db_thread(self._shared.remove, public_id)
                self._spawn(asyncio.get_running_loop(), logged(removal, f"shared pending {public_id}"))
            return
        late = self._late.pop(public_id, None)
        if late is not None:
            self._stats["late_landed"] += 1
            logger.info("late row of response %s landed; releasing its tombstone", public_id)
            late.landed.set()
            call_logged(late.on_late_landing, "on_late_landing")

    # Embedded sweeps and plumbing ------------------------------------------------------------

    async def run_sweeper(self) -> None:
        """The periodic cleanups, in this process, for the embedded default without beat (PER-5).

        Runs until cancelled; returns at once when a sweeper already runs on this loop.
        """
        if running_here(self._sweeper):
            return
        self._sweeper = asyncio.current_task()
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            # Tombstones first: one whose row landed and then expired still counts as landed.
            for sweep in (services.tombstones_purge, services.responses_purge_expired):
                try:
                    await self._in_db_thread(sweep)
                except Exception:
                    logger.exception("embedded sweep %s failed", sweep.__name__)

    def _is_eager(self) -> bool:
        if self._eager is not None:
            return self._eager
        from mlxhost.celery import app

        return bool(app.conf.task_always_eager)

    def _in_db_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(
            self._db_pool, partial(with_db, fn, *args, **kwargs)
        )

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        task = loop.create_task(coro)
        self._tasks.add(task)  # keep a reference until done, or the task may be collected
        task.add_done_callback(self._tasks.discard)
        return task
