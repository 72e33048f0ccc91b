"""What the write-behind store keeps: the record a finished turn stores, its pending and late
entries, the pending table shared across a fleet, and how a store is wired (PER-1..6, issue 15)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import close_old_connections

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
    weights_key: tuple[str, ...]  # (source, revision, fingerprint[, KV format]); a list is accepted
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
        if len(key) not in (3, 4):
            raise ValueError("weights_key is (source, revision, fingerprint[, KV format]).")
        object.__setattr__(self, "weights_key", key)

    def as_payload(self) -> dict[str, Any]:
        """The persist task's argument: a dict of JSON primitives."""
        payload = asdict(self)
        payload["weights_key"] = list(self.weights_key)
        return payload


@dataclass(slots=True, eq=False)
class Pending:
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
class Late:
    """A write the breaker gave up on, kept only for its late landing: the record (its text) is
    dropped at the trip."""

    owner_id: int
    expires_at: float
    on_late_landing: Callback | None
    landed: asyncio.Event
    next_check_at: float
    interval_s: float


def with_db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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


@dataclass(frozen=True, slots=True)
class StoreWiring:
    """Where a store sends its writes and how it tells time: production's by default, tests inject.

    publish: sends one payload to the broker (default: `CeleryPublisher`).
    eager: run the task inline instead of publishing; None follows `task_always_eager`.
    broker_url: publish to this broker (None: `broker_url`, from CELERY_BROKER_URL).
    queue: the Celery queue to publish to (None: the default routing).
    shared: where other hosts see this process's pending writes (None: nowhere).
    late_limit: how many given-up writes are watched for a late landing (LATE_LIMIT).
    """

    publish: Publish | None = None
    eager: bool | None = None
    broker_url: str | None = None
    queue: str | None = None
    shared: SharedPending | None = None
    clock: Callable[[], float] = time.monotonic
    late_limit: int = LATE_LIMIT


def running_here(task: asyncio.Task[Any] | None) -> bool:
    """Whether `task` is another live task on the running loop (a loop per test, one in daphne)."""
    return (
        task is not None
        and task is not asyncio.current_task()
        and not task.done()
        and task.get_loop() is asyncio.get_running_loop()
    )


def call_logged(callback: Callback | None, what: str) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:
        logger.exception("persist callback %s failed", what)


async def logged(awaitable: Any, what: str) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("writing %s failed", what)
