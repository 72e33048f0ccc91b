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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings

from mlxhost.runtime import PROCESS, Shared, runtime_settings
from mlxhost.runtime.config import PersistenceSettings
from models_app.catalogue import selectors, services
from models_app.models import StoredResponse
from models_app.persistence.breaker import PendingWrites
from models_app.persistence.publishing import CeleryPublisher, persist_eagerly
from models_app.persistence.records import (
    Callback,
    Pending,
    ResponseRecord,
    SharedPending,
    StorageTimeoutError,
    StoreWiring,
)

__all__ = [
    "PERSISTENCE",
    "Persistence",
    "ResponseRecord",
    "SharedPending",
    "StorageTimeoutError",
    "persistence",
]

logger = logging.getLogger(__name__)


class Persistence(PendingWrites):
    """This process's pending writes, publisher, monitor and breaker; see the module docstring.

    Everything but the thread pools runs on the event loop; the tables are touched there only.
    A store a test builds by hand has the settings' defaults (`PersistenceSettings()`);
    `persistence()` builds the process's from the settings.
    """

    def __init__(self, config: PersistenceSettings | None = None, wiring: StoreWiring | None = None) -> None:
        config = config if config is not None else PersistenceSettings()
        wiring = wiring if wiring is not None else StoreWiring()
        super().__init__(config, wiring)
        self._publisher = wiring.publish or CeleryPublisher(
            timeout_s=config.publish_timeout_s, url=wiring.broker_url, queue=wiring.queue
        )
        self._publish_pool = ThreadPoolExecutor(1, thread_name_prefix="mlxhost-persist-publish")
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
        self._pending[public_id] = Pending(
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

    # Draining ----------------------------------------------------------------------------------

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


def _build_persistence() -> Persistence:
    wiring = StoreWiring(shared=SharedPending() if settings.REDIS_URL else None)
    return Persistence(runtime_settings().persistence, wiring)


# This process's `Persistence`, built from settings on first use; tests put one with short
# timeouts or a fake publish (`PROCESS.put(PERSISTENCE, store)`), metrics peek so they build nothing.
PERSISTENCE: Shared[Persistence] = Shared("write-behind store", _build_persistence)


def persistence() -> Persistence:
    """This process's `Persistence`, built from settings on first use."""
    return PROCESS.get(PERSISTENCE)
