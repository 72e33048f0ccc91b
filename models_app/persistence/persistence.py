"""The web process's side of stored responses: publish the persist task, track pending writes, breaker.

A finished turn is handed to `persistence().record(...)` on the event loop, and the caller awaits
the returned handoff BEFORE it sends the terminal event, so a turn whose final event reached the
client survives the process being killed right after (PER-1; issue 10 item 5). The handoff is
durable once the persist task is published to the broker (bounded time), or once the row is
written inline in a thread when the broker is down or absent (PER-3), or by the eager task in the
embedded default. A client that hung up is not waited for: its record is handed off in the background. Until the row lands, the id sits in a pending-writes
table, so a continuation can tell "still landing" (wait, then 503) from "gone" (404) (PER-2). A
write still pending after the hard timeout trips the breaker: the instance retention is released
and a tombstone is recorded, and the id is watched until its row lands late (PER-4, REG-7).

In a fleet (issue 15) the pending id is also shared: with Redis configured, each write puts
`pending-write:<id>` (its owner, expiring at the hard deadline) in the shared cache before the
handoff completes and removes it when the row lands, so a continuation on ANY host waits for the
row within the same bound, or answers 503, never a false 404 (`SharedPending`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from django.conf import settings
from django.db import close_old_connections

from mlxhost.runtime import PROCESS, Shared, runtime_settings
from mlxhost.runtime.config import PersistenceSettings
from models_app.catalogue import selectors, services
from models_app.models import StoredResponse
from models_app.persistence.publishing import CeleryPublisher, persist_eagerly

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache

logger = logging.getLogger(__name__)

T = TypeVar("T")
Callback = Callable[[], object]  # any result is ignored (Retention.retire returns the id)
Publish = Callable[[dict[str, Any]], None]

TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
STAT_KEYS = (
    "recorded",
    "published",
    "publish_failures",
    "inline_writes",
    "eager_writes",
    "write_failures",
    "landed",
    "breaker_trips",
    "late_landed",
    "tombstones_expired",
)
LANDED_CHUNK = 500
# Writes the breaker gave up on (PER-4) are watched for a late landing: at most LATE_LIMIT of them
# (beyond, the oldest is given up as if its tombstone expired), each checked ever more rarely, the
# interval doubling from the poll up to LATE_POLL_MAX_S, so neither memory nor the database's load
# grows with the trip rate (issue 25).
LATE_LIMIT = 4096
LATE_POLL_MAX_S = 60.0


class StorageTimeoutError(Exception):
    """The stored response is still being written by this process and did not land in time (PER-2).

    The API answers 503 `storage_timeout` (retryable), never 404.
    """

    code = "storage_timeout"
    retry_after = 1


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """What a finished turn stores, as JSON primitives (the persist task's payload)."""

    public_id: str
    owner_id: int
    alias_id: int | None
    alias_name: str
    instance_id: int
    weights_fingerprint: str
    weights_key: tuple[str, str, str]  # (source, revision, fingerprint); a list is accepted
    boot_id: str
    previous_response_id: str = ""
    request: dict[str, Any] = field(default_factory=dict)
    output: list[Any] = field(default_factory=list)
    output_text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    status: str = "completed"
    retention_s: int | None = None  # None/0: MLXHOST_RESPONSE_RETENTION_S; else clamped to [60 s, 30 d]
    created_at: float = field(default_factory=time.time)  # unix seconds, when the turn ran

    def __post_init__(self) -> None:
        if self.status not in TERMINAL_STATUSES:
            raise ValueError(f"A stored response ends {sorted(TERMINAL_STATUSES)}, not {self.status!r}.")
        key = tuple(self.weights_key)
        if len(key) != 3:
            raise ValueError("weights_key is (source, revision, fingerprint).")
        object.__setattr__(self, "weights_key", key)

    def as_payload(self) -> dict[str, Any]:
        """The persist task's argument: a dict of JSON primitives."""
        payload = asdict(self)
        payload["weights_key"] = list(self.weights_key)
        return payload


@dataclass(slots=True, eq=False)
class _Pending:
    record: ResponseRecord
    recorded_at: float
    deadline: float
    on_settled: Callback | None
    on_force_release: Callback | None
    on_late_landing: Callback | None
    landed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def owner_id(self) -> int:
        return self.record.owner_id


@dataclass(slots=True, eq=False)
class _Late:
    """A write the breaker gave up on, kept only for its late landing: the record (its text) is
    dropped at the trip."""

    owner_id: int
    expires_at: float
    on_late_landing: Callback | None
    landed: asyncio.Event
    next_check_at: float
    interval_s: float


def _with_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    # Runs in a pool thread: honour CONN_MAX_AGE and drop broken connections, as a request would.
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


class SharedPending:
    """Pending writes every host can see: owner ids in the shared (Redis) cache, by response id.

    Called from worker threads. Cache errors are logged and ignored: the write itself goes on, and
    a continuation on another host then finds no pending id (the behaviour without Redis).
    """

    KEY = "pending-write:{public_id}"

    def __init__(self, cache: BaseCache | None = None) -> None:
        from django.core.cache import caches

        self._cache = cache if cache is not None else caches["default"]

    def add(self, public_id: str, owner_id: int, ttl_s: float) -> None:
        try:
            self._cache.set(self.KEY.format(public_id=public_id), owner_id, timeout=max(1, round(ttl_s)))
        except Exception as exc:
            logger.warning("could not share the pending write of %s (%s)", public_id, exc)

    def remove(self, public_id: str) -> None:
        try:
            self._cache.delete(self.KEY.format(public_id=public_id))
        except Exception as exc:
            logger.warning("could not clear the shared pending write of %s (%s)", public_id, exc)

    def owner(self, public_id: str) -> int | None:
        try:
            value = self._cache.get(self.KEY.format(public_id=public_id))
        except Exception as exc:
            logger.warning("could not read the shared pending writes (%s)", exc)
            return None
        return value if isinstance(value, int) else None


# The settings' defaults, for a store a test builds by hand (`persistence()` reads the settings).
_DEFAULTS = PersistenceSettings()


class Persistence:
    """This process's pending writes, publisher, monitor and breaker; see the module docstring.

    Everything but the thread pools runs on the event loop; the tables are touched there only.
    """

    def __init__(
        self,
        *,
        publish_timeout_s: float = _DEFAULTS.publish_timeout_s,
        hard_timeout_s: float = _DEFAULTS.hard_timeout_s,
        wait_s: float = _DEFAULTS.wait_s,
        poll_s: float = _DEFAULTS.poll_s,
        tombstone_ttl_s: float = _DEFAULTS.tombstone_ttl_s,
        late_limit: int = LATE_LIMIT,
        sweep_interval_s: float = _DEFAULTS.sweep_interval_s,
        publish: Publish | None = None,
        eager: bool | None = None,
        broker_url: str | None = None,
        queue: str | None = None,
        shared: SharedPending | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        publish: sends one payload to the broker (default: `CeleryPublisher`); tests inject one.
        eager: run the task inline instead of publishing; None follows `task_always_eager`.
        broker_url: publish to this broker (None: `broker_url`, from CELERY_BROKER_URL).
        queue: the Celery queue to publish to (None: the default routing).
        shared: where other hosts see this process's pending writes (None: nowhere).
        """
        self.publish_timeout_s = publish_timeout_s
        self.hard_timeout_s = hard_timeout_s
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self.late_limit = late_limit
        self.sweep_interval_s = sweep_interval_s
        self._publisher = publish or CeleryPublisher(timeout_s=publish_timeout_s, url=broker_url, queue=queue)
        self._eager = eager
        self._shared = shared
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._late: dict[str, _Late] = {}  # oldest trip first
        self._stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)
        self._stats["lag_s_sum"] = 0.0
        self._stats["lag_s_max"] = 0.0
        self._publish_pool = ThreadPoolExecutor(1, thread_name_prefix="mlxhost-persist-publish")
        self._db_pool = ThreadPoolExecutor(4, thread_name_prefix="mlxhost-persist-db")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._query: asyncio.Future[set[str]] | None = None
        self._closed = False

    # Recording ----------------------------------------------------------------------------

    def record(
        self,
        record: ResponseRecord,
        *,
        on_settled: Callback | None = None,
        on_force_release: Callback | None = None,
        on_late_landing: Callback | None = None,
    ) -> asyncio.Future[None]:
        """Store `record` off the event loop; call on the loop when the turn has ended.

        Returns the handoff: it completes once the record is durable (published to the broker, or
        written inline or eagerly), or once that failed and was logged (the entry then stays
        pending for the monitor and the breaker). It never raises. Await it (it is shielded, so a
        cancelled waiter does not cancel the write) before telling the client the turn is over;
        ignore it when the client is gone.

        Exactly one of `on_settled` (the row landed) and `on_force_release` (the breaker gave up
        after the hard timeout) is called, on the loop. After `on_force_release`, `on_late_landing`
        is called once when the row finally lands or the tombstone expires unlanded.

        Raises:
            ValueError: this id is already pending.
            RuntimeError: not called on a running event loop.
        """
        loop = asyncio.get_running_loop()
        public_id = record.public_id
        if public_id in self._pending or public_id in self._late:
            raise ValueError(f"Response {public_id} is already being stored.")
        now = self._clock()
        self._pending[public_id] = _Pending(
            record=record,
            recorded_at=now,
            deadline=now + self.hard_timeout_s,
            on_settled=on_settled,
            on_force_release=on_force_release,
            on_late_landing=on_late_landing,
        )
        self._stats["recorded"] += 1
        task = self._spawn(loop, self._persist(record))
        self._ensure_monitor(loop)
        return asyncio.shield(task)

    async def _persist(self, record: ResponseRecord) -> None:
        payload = record.as_payload()
        public_id = record.public_id
        if self._shared is not None:  # before the handoff completes: visible before the last event
            await self._in_db_thread(self._shared.add, public_id, record.owner_id, self.hard_timeout_s)
        try:
            if self._is_eager():
                await self._in_db_thread(persist_eagerly, payload)
                self._stats["eager_writes"] += 1
            elif await self._publish(payload):
                self._stats["published"] += 1
                return  # the worker writes it; the monitor sees it land
            else:
                await self._in_db_thread(services.response_persist, payload=payload)
                self._stats["inline_writes"] += 1
        except Exception:
            # Left pending: the monitor may still see it land, or the breaker gives it up.
            self._stats["write_failures"] += 1
            logger.exception("storing response %s failed", public_id)
            return
        self._landed(public_id)

    async def _publish(self, payload: dict[str, Any]) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._publish_pool, self._publisher, payload)
        try:
            # On timeout the wrapped job is cancelled if it has not started; if it is running and
            # publishes after all, the worker's idempotent upsert finds the inline row (PER-3).
            await asyncio.wait_for(future, timeout=self.publish_timeout_s)
        except Exception as exc:
            self._stats["publish_failures"] += 1
            logger.warning("publishing persist of %s failed (%s); writing inline", payload["public_id"], exc)
            return False
        return True

    def _is_eager(self) -> bool:
        if self._eager is not None:
            return self._eager
        from mlxhost.celery import app

        return bool(app.conf.task_always_eager)

    # Reading -------------------------------------------------------------------------------

    async def fetch(self, *, public_id: str, owner_id: int, wait_s: float | None = None) -> StoredResponse:
        """The caller's stored response, waiting for it when its write is still pending here (PER-2).

        Tenant-scoped (PER-6): another owner's id, landed or pending, is exactly a missing one.

        Raises:
            StoredResponse.DoesNotExist: no such response for this owner.
            StorageTimeoutError: its write is pending in this process and did not land in `wait_s`
                (default `wait_s`, MLXHOST_PERSIST_WAIT_S).
        """
        # Look at the pending table before the database: a write that lands in between is then
        # still seen as pending (and re-read), never as a false 404.
        entry = self._lookup(public_id)
        row = await self._get(public_id, owner_id)
        if row is not None:
            if entry is not None:
                # Seen landed: settle now rather than at the monitor's next tick, so a delete
                # that follows this read leaves a missing row, not a write still "pending".
                self._landed(public_id)
            return row
        entry = entry or self._lookup(public_id)
        if entry is None and self._shared is not None:
            return await self._fetch_shared(public_id, owner_id, self.wait_s if wait_s is None else wait_s)
        if entry is None or entry.owner_id != owner_id:
            raise StoredResponse.DoesNotExist(f"No stored response {public_id}.")
        if not entry.landed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.landed.wait(), self.wait_s if wait_s is None else wait_s)
        row = await self._get(public_id, owner_id)
        if row is not None:
            return row
        if entry.landed.is_set():  # it landed and was deleted (or expired) since
            raise StoredResponse.DoesNotExist(f"No stored response {public_id}.")
        raise StorageTimeoutError(f"Response {public_id} is still being stored; retry shortly.")

    async def _fetch_shared(self, public_id: str, owner_id: int, wait_s: float) -> StoredResponse:
        """Another host is writing `public_id` (the shared pending table says so): poll the database
        for its row until `wait_s` has passed."""
        assert self._shared is not None
        if await self._in_db_thread(self._shared.owner, public_id) != owner_id:
            raise StoredResponse.DoesNotExist(f"No stored response {public_id}.")
        deadline = self._clock() + wait_s
        while True:
            row = await self._get(public_id, owner_id)
            if row is not None:
                return row
            if await self._in_db_thread(self._shared.owner, public_id) is None:
                # Landed and deleted since, or the writer's deadline passed: gone, as a missing row.
                raise StoredResponse.DoesNotExist(f"No stored response {public_id}.")
            if self._clock() >= deadline:
                raise StorageTimeoutError(f"Response {public_id} is still being stored; retry shortly.")
            await asyncio.sleep(self.poll_s)  # the row lands in another process: poll for it

    async def _get(self, public_id: str, owner_id: int) -> StoredResponse | None:
        try:
            return await self._in_db_thread(selectors.response_get, public_id=public_id, owner_id=owner_id)
        except StoredResponse.DoesNotExist:
            return None

    def _lookup(self, public_id: str) -> _Pending | _Late | None:
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
        if _running_here(self._monitor):
            return
        self._wake, self._query = asyncio.Event(), None
        self._monitor = asyncio.current_task()
        await self._watch()

    def _ensure_monitor(self, loop: asyncio.AbstractEventLoop) -> None:
        if not _running_here(self._monitor):
            self._wake, self._query = asyncio.Event(), None
            self._monitor = loop.create_task(self._watch(), name="persist-monitor")
        elif self._wake is not None:
            self._wake.set()
        if self._is_eager() and not _running_here(self._sweeper):
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
        _call(late.on_late_landing, "on_late_landing")

    def _trip(self, entry: _Pending, now: float) -> None:
        record = entry.record
        del self._pending[record.public_id]
        self._late[record.public_id] = _Late(
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
        _call(entry.on_force_release, "on_force_release")
        write = self._in_db_thread(
            services.tombstone_record,
            instance_id=record.instance_id,
            weights_key=record.weights_key,
            public_id=record.public_id,
        )
        self._spawn(asyncio.get_running_loop(), _logged(write, f"tombstone for {record.public_id}"))

    def _landed(self, public_id: str) -> None:
        entry = self._pending.pop(public_id, None)
        if entry is not None:
            lag = self._clock() - entry.recorded_at
            self._stats["landed"] += 1
            self._stats["lag_s_sum"] += lag
            self._stats["lag_s_max"] = max(self._stats["lag_s_max"], lag)
            entry.landed.set()
            _call(entry.on_settled, "on_settled")
            if self._shared is not None:
                removal = self._in_db_thread(self._shared.remove, public_id)
                self._spawn(asyncio.get_running_loop(), _logged(removal, f"shared pending {public_id}"))
            return
        late = self._late.pop(public_id, None)
        if late is not None:
            self._stats["late_landed"] += 1
            logger.info("late row of response %s landed; releasing its tombstone", public_id)
            late.landed.set()
            _call(late.on_late_landing, "on_late_landing")

    # Embedded sweeps, draining, plumbing -----------------------------------------------------

    async def run_sweeper(self) -> None:
        """The periodic cleanups, in this process, for the embedded default without beat (PER-5).

        Runs until cancelled; returns at once when a sweeper already runs on this loop.
        """
        if _running_here(self._sweeper):
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

    async def flush(self, *, timeout_s: float) -> bool:
        """Wait until every write this process started was published or written (shutdown)."""
        tasks = [task for task in self._tasks if not task.done()]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        return not pending

    async def wait_idle(self, *, timeout_s: float) -> bool:
        """Wait until no write is pending (each landed or was given up by the breaker)."""
        deadline = time.monotonic() + timeout_s
        while self._pending or any(not task.done() for task in self._tasks):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def aclose(self) -> None:
        """`close()`, then wait until this loop's monitor and sweeper have ended (shutdown)."""
        self.close()
        loop = asyncio.get_running_loop()
        tasks = [t for t in (self._monitor, self._sweeper) if t is not None and t.get_loop() is loop]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop the monitor and the threads (tests, shutdown); pending entries are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in (self._monitor, self._sweeper):
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed already
                    task.get_loop().call_soon_threadsafe(task.cancel)
        self._publish_pool.submit(getattr(self._publisher, "close", lambda: None))
        self._publish_pool.shutdown(wait=False, cancel_futures=False)
        self._db_pool.shutdown(wait=False, cancel_futures=True)

    def _in_db_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(
            self._db_pool, partial(_with_db, fn, *args, **kwargs)
        )

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        task = loop.create_task(coro)
        self._tasks.add(task)  # keep a reference until done, or the task may be collected
        task.add_done_callback(self._tasks.discard)
        return task


def _running_here(task: asyncio.Task[Any] | None) -> bool:
    """Whether `task` is another live task on the running loop (a loop per test, one in daphne)."""
    return (
        task is not None
        and task is not asyncio.current_task()
        and not task.done()
        and task.get_loop() is asyncio.get_running_loop()
    )


def _call(callback: Callback | None, what: str) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:
        logger.exception("persist callback %s failed", what)


async def _logged(awaitable: Any, what: str) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("writing %s failed", what)


def _build_persistence() -> Persistence:
    config = runtime_settings().persistence
    return Persistence(
        publish_timeout_s=config.publish_timeout_s,
        hard_timeout_s=config.hard_timeout_s,
        wait_s=config.wait_s,
        poll_s=config.poll_s,
        tombstone_ttl_s=config.tombstone_ttl_s,
        sweep_interval_s=config.sweep_interval_s,
        shared=SharedPending() if settings.REDIS_URL else None,
    )


# This process's `Persistence`, built from settings on first use; tests put one with short
# timeouts or a fake publish (`PROCESS.put(PERSISTENCE, store)`), metrics peek so they build nothing.
PERSISTENCE: Shared[Persistence] = Shared("write-behind store", _build_persistence)


def persistence() -> Persistence:
    """This process's `Persistence`, built from settings on first use."""
    return PROCESS.get(PERSISTENCE)
