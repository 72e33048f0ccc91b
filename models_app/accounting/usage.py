"""Usage per API key and per user (KEY-1, KEY-2): finished turns tallied in memory, written behind.

Every turn that reached the model, on any surface, ends with the engine's `Done`; the turn
service hands it to `recorder().turn_ended(...)` on the event loop, which only adds to an
in-memory tally (no I/O next to a streamed token). Embedding requests (`embedded`),
`count_tokens` calls (`counted`) and refused requests (`refused`: by the key's limits, by a busy
model) are tallied the same way. A flusher task writes the tallies every
MLXHOST_USAGE_FLUSH_S in a thread of its own, as F() increments of one `UsageDay` row per key
per UTC day, then adds the tokens to the limiter's daily counters (KEY-4) and stamps the keys'
`last_used_at` (at most once a minute per key). Shutdown flushes what is left; a process killed
with SIGKILL loses at most the last interval's tallies. A failed write keeps its tallies for
the next flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from mlxhost.engine import Done
from mlxhost.runtime import PROCESS, Shared
from models_app.accounting import limits
from models_app.models import ApiKey, UsageDay

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from django.db.models import QuerySet

    from mlxhost.engine import Failed

logger = logging.getLogger(__name__)

# `last_used_at` is written at most this often per key (and process): a busy key costs nothing.
TOUCH_INTERVAL_S = 60.0
TOKEN_COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "output_tokens")
# count_tokens calls, and refused requests (by the key's limits; by a busy model).
OTHER_COUNTERS = ("count_requests", "rate_limited", "overloaded")
COUNTERS = (*TOKEN_COUNTERS, *OTHER_COUNTERS)
# New columns go last, so a spreadsheet reading the older ones by position still reads them.
CSV_HEADER = ("day", "user", "key", "key prefix", *TOKEN_COUNTERS, "total_tokens", *OTHER_COUNTERS)
Refusal = Literal["rate_limited", "overloaded"]


@dataclass(slots=True)
class Tally:
    """Requests and tokens not yet written, for one key (or browser session) on one day."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    count_requests: int = 0
    rate_limited: int = 0
    overloaded: int = 0

    def add(self, other: Tally) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


# (UTC day, owner id, key id; None for a browser session) -> what it used.
TallyKey = tuple[date, int, int | None]


class UsageRecorder:
    """This process's usage tallies and their flusher; see the module docstring."""

    def __init__(self, *, flush_interval_s: float, clock: Callable[[], float] = time.time) -> None:
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # tallies are added on the loop and taken by a shutdown flush
        self._tallies: dict[TallyKey, Tally] = {}
        self._seen: dict[int, float] = {}  # key id -> last use, not yet written
        self._touched: dict[int, float] = {}  # key id -> when this process last wrote last_used_at
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxhost-usage")  # one flush at a time
        self._flusher: asyncio.Task[None] | None = None

    # Recording (on the loop; O(1), no I/O) ------------------------------------------------------

    def turn_ended(self, event: Done | Failed, *, owner_id: int, key_id: int | None, choice: int = 0) -> None:
        """Tally a turn's usage as its terminal event is posted, read by the client or not.

        A turn that never reached the model (refused, or cancelled while it waited) counts nothing.
        A later choice of a request (`choice` > 0, OpenAI `n`) adds its completion tokens only:
        the request and its prompt count once, with its first choice, as the answer's usage does.
        """
        if not isinstance(event, Done):
            return
        usage = event.usage
        if usage.prompt_tokens == 0 and usage.completion_tokens == 0:
            return
        if choice:
            turn = Tally(0, 0, 0, usage.completion_tokens)
        else:
            turn = Tally(1, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        self._add(turn, owner_id=owner_id, key_id=key_id)

    def embedded(self, prompt_tokens: int, *, owner_id: int, key_id: int | None) -> None:
        """Tally an embedding request that ran: one request and its input tokens (KEY-2)."""
        self._add(Tally(requests=1, prompt_tokens=prompt_tokens), owner_id=owner_id, key_id=key_id)

    def counted(self, *, owner_id: int, key_id: int | None) -> None:
        """Tally a `count_tokens` call: a count of its own, no request and no tokens (KEY-2)."""
        self._add(Tally(count_requests=1), owner_id=owner_id, key_id=key_id)

    def refused(self, reason: Refusal, *, owner_id: int, key_id: int | None) -> None:
        """Tally a request refused by the key's limits or by a busy model (KEY-2)."""
        tally = Tally(rate_limited=1) if reason == "rate_limited" else Tally(overloaded=1)
        self._add(tally, owner_id=owner_id, key_id=key_id)

    def _add(self, tally: Tally, *, owner_id: int, key_id: int | None) -> None:
        key: TallyKey = (limits.utc_day(self._clock()), owner_id, key_id)
        with self._lock:
            self._tallies.setdefault(key, Tally()).add(tally)
        self._ensure_flusher()

    def key_used(self, key_id: int) -> None:
        """Note that a request presented this key (its `last_used_at`, at the next flush)."""
        with self._lock:
            self._seen[key_id] = self._clock()
        self._ensure_flusher()

    def pending(self) -> dict[TallyKey, Tally]:
        """A copy of what the next flush writes (tests, metrics)."""
        with self._lock:
            return {key: Tally(*(getattr(t, n) for n in COUNTERS)) for key, t in self._tallies.items()}

    # Flushing ------------------------------------------------------------------------------------

    def _ensure_flusher(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a sync caller (a test, a shutdown flush) flushes itself
        flusher = self._flusher
        if flusher is None or flusher.done() or flusher.get_loop() is not loop:
            self._flusher = loop.create_task(self._run(), name="usage-flusher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # never let one bad flush stop the next
                logger.exception("usage flush failed")

    async def flush(self) -> None:
        """Write every tally taken so far, in the recorder's thread; returns when written."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._flush_in_thread)

    def _flush_in_thread(self) -> None:
        close_old_connections()  # a pool thread: honour CONN_MAX_AGE, drop broken connections
        try:
            self.flush_sync()
        finally:
            close_old_connections()

    def flush_sync(self) -> None:
        """Write every tally taken so far, in the calling thread."""
        with self._lock:
            tallies, self._tallies = self._tallies, {}
            seen, self._seen = self._seen, {}
        if tallies or seen:
            self._write(tallies, seen)

    def _write(self, tallies: dict[TallyKey, Tally], seen: dict[int, float]) -> None:
        try:
            usage_add(tallies=tallies)
        except Exception:
            logger.exception("writing usage failed; kept for the next flush")
            with self._lock:
                for key, tally in tallies.items():
                    self._tallies.setdefault(key, Tally()).add(tally)
        else:
            tokens: dict[tuple[int, date], int] = {}
            for (day, _owner, key_id), tally in tallies.items():
                if key_id is not None:
                    tokens[(key_id, day)] = tokens.get((key_id, day), 0) + tally.total_tokens
            limits.limiter().add_tokens(tokens)
        due = {k: at for k, at in seen.items() if at - self._touched.get(k, 0.0) >= TOUCH_INTERVAL_S}
        if due:
            try:
                apikeys_touch(used_at=due)
            except Exception:
                logger.exception("stamping last_used_at failed")
            else:
                self._touched.update(due)

    async def aclose(self) -> None:
        """Flush what is left and stop the flusher (shutdown)."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None and flusher.get_loop() is asyncio.get_running_loop():
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        await self.flush()

    def close(self) -> None:
        """Drop the tallies and stop the flusher without writing (tests). Idempotent."""
        with self._lock:
            self._tallies.clear()
            self._seen.clear()
        flusher, self._flusher = self._flusher, None
        if flusher is not None and not flusher.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                flusher.get_loop().call_soon_threadsafe(flusher.cancel)
        self._pool.shutdown(wait=False, cancel_futures=True)


# Writes (services) --------------------------------------------------------------------------------


def usage_add(*, tallies: dict[TallyKey, Tally]) -> None:
    """Add each tally to its day's row, creating the row on the day's first flush (KEY-2).

    Each row is its own statement (autocommit): one failure never loses the others. Tallies of a
    key or user deleted meanwhile are dropped with them.
    """
    key_ids = {key_id for _day, _owner, key_id in tallies if key_id is not None}
    owner_ids = {owner for _day, owner, _key in tallies}
    live_keys = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
    live_owners = set(get_user_model().objects.filter(pk__in=owner_ids).values_list("pk", flat=True))
    for (day, owner_id, key_id), tally in tallies.items():
        if owner_id in live_owners and (key_id is None or key_id in live_keys):
            _add_row(day, owner_id, key_id, tally)


def _add_row(day: date, owner_id: int, key_id: int | None, tally: Tally) -> None:
    rows = UsageDay.objects.filter(day=day, owner_id=owner_id, key_id=key_id)
    increments: dict[str, Any] = {name: F(name) + getattr(tally, name) for name in COUNTERS}
    if rows.update(**increments, updated_at=timezone.now()):
        return
    try:
        with transaction.atomic():
            UsageDay.objects.create(
                day=day, owner_id=owner_id, key_id=key_id, **{n: getattr(tally, n) for n in COUNTERS}
            )
    except IntegrityError:
        # Another process made the row first (one per day and key), or the key just went.
        rows.update(**increments, updated_at=timezone.now())


def apikeys_touch(*, used_at: dict[int, float]) -> None:
    """Stamp each key's `last_used_at`, unless a stamp under a minute old is there (any process)."""
    for key_id, at in used_at.items():
        when = datetime.fromtimestamp(at, UTC)
        recent = Q(last_used_at__gte=when - timedelta(seconds=TOUCH_INTERVAL_S))
        ApiKey.objects.filter(pk=key_id).exclude(recent).update(last_used_at=when)


# Reads (the admin's report) -----------------------------------------------------------------------


def usage_by_day(*, rows: QuerySet[UsageDay]) -> list[dict[str, Any]]:
    """`rows` summed per day, oldest first: what the chart and the daily table show."""
    summed = rows.order_by().values("day").annotate(**{n: Sum(n) for n in COUNTERS}).order_by("day")
    days = [dict(row) for row in summed]
    for row in days:
        row["total_tokens"] = row["prompt_tokens"] + row["output_tokens"]
    return days


def usage_totals(*, rows: QuerySet[UsageDay]) -> dict[str, int]:
    """`rows` summed over every day."""
    summed = rows.order_by().aggregate(**{n: Sum(n) for n in COUNTERS})
    totals = {name: summed[name] or 0 for name in COUNTERS}
    totals["total_tokens"] = totals["prompt_tokens"] + totals["output_tokens"]
    return totals


def usage_by_owner(*, rows: QuerySet[UsageDay], limit: int = 20) -> list[dict[str, Any]]:
    """`rows` summed per user over every day, the heaviest first: the per-user totals."""
    summed = [
        dict(row)
        for row in rows.order_by()
        .values("owner_id", "owner__username")
        .annotate(**{n: Sum(n) for n in COUNTERS})
    ]
    for row in summed:
        row["total_tokens"] = row["prompt_tokens"] + row["output_tokens"]
    summed.sort(key=lambda row: (-row["total_tokens"], row["owner__username"]))
    return summed[:limit]


def usage_chart_data(*, days: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The chart's series: unix seconds of each day, its token counts and its refused requests
    (by the key's limits or a busy model), for static JS."""
    return {
        "t": [int(datetime.combine(row["day"], datetime.min.time(), UTC).timestamp()) for row in days],
        "prompt": [row["prompt_tokens"] for row in days],
        "cached": [row["cached_tokens"] for row in days],
        "output": [row["output_tokens"] for row in days],
        "refused": [row["rate_limited"] + row["overloaded"] for row in days],
    }


def _cell(value: object) -> str:
    # Spreadsheets run a cell that starts with = + - @ as a formula; key names are free text.
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def usage_csv(*, rows: QuerySet[UsageDay]) -> Iterator[str]:
    """`rows` as CSV lines, one per key (or browser session) per day, newest first."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)

    def line(values: tuple[object, ...]) -> str:
        writer.writerow([_cell(v) for v in values])
        text = buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
        return text

    yield line(CSV_HEADER)
    for row in rows.select_related("owner", "key").order_by("-day", "owner__username", "key__name"):
        key_name, prefix = (row.key.name, row.key.prefix) if row.key else ("(browser session)", "")
        counts = tuple(getattr(row, name) for name in TOKEN_COUNTERS)
        others = tuple(getattr(row, name) for name in OTHER_COUNTERS)
        yield line(
            (
                row.day.isoformat(),
                row.owner.get_username(),
                key_name,
                prefix,
                *counts,
                row.total_tokens,
                *others,
            )
        )


def _build_recorder() -> UsageRecorder:
    return UsageRecorder(flush_interval_s=settings.MLXHOST_USAGE_FLUSH_S)


# This process's usage recorder, built from settings on first use (tests start each with an empty one).
RECORDER: Shared[UsageRecorder] = Shared("usage recorder", _build_recorder)


def recorder() -> UsageRecorder:
    """This process's usage recorder, built from settings on first use."""
    return PROCESS.get(RECORDER)


async def flush_usage() -> None:
    """Write the last tallies and stop the flusher (after the stored responses' flush, KEY-2, OPS-5)."""
    store = PROCESS.peek(RECORDER)
    if store is not None:
        await store.aclose()
