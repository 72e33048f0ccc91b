"""Persistence through a real Celery worker process and a real Redis (PER-1, PER-2, PER-3)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse, urlunparse

import pytest
import redis

from mlxhost.runtime import PROCESS
from models_app.models import StoredResponse
from models_app.persistence import persistence as persistence_module
from tests.models_app.support import build_persistence, make_record, off_loop
from tests.support import eventually, wait_until

if TYPE_CHECKING:
    from models_app.persistence.persistence import Persistence

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.celery, pytest.mark.timeout(180)]


@pytest.fixture
def make_store(celery_publishes, queue):
    """A `Persistence` that publishes to this test's queue on `broker_url`."""
    built: list[Persistence] = []

    def build(broker_url: str, **options) -> Persistence:
        options.setdefault("poll_s", 0.05)
        options.setdefault("hard_timeout_s", 150.0)  # these tests never want the breaker
        store = build_persistence(broker_url=broker_url, queue=queue, **options)
        PROCESS.put(persistence_module.PERSISTENCE, store)
        built.append(store)
        return store

    yield build
    for store in built:
        store.close()
    PROCESS.put(persistence_module.PERSISTENCE, None)


@off_loop
def stored_texts() -> dict[str, str]:
    rows = list(StoredResponse.objects.values_list("public_id", "output_text"))
    texts = dict(rows)
    assert len(texts) == len(rows)  # never a duplicate
    return texts


def record_many(store: Persistence, owner_id: int, count: int, label: str) -> dict[str, str]:
    texts = {}
    for i in range(count):
        record = make_record(owner_id, text=f"{label} turn {i}:" + " word" * (i % 7))
        store.record(record)
        texts[record.public_id] = record.output_text
    return texts


def queue_drained(redis_url: str, queue: str, timeout: float = 30.0) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: not client.llen(queue), timeout=timeout, what="the worker to empty the queue")
    finally:
        client.close()


async def test_fifty_turns_become_exactly_fifty_rows(user, workers, make_store, redis_url):
    """PER-1: 50 stored turns, published to Redis and written by a real worker, are exactly 50 rows
    with the text that was produced; each task ran once."""
    worker = await workers.start()
    store = make_store(redis_url)
    texts = record_many(store, user.pk, 50, "celery")
    assert await store.wait_idle(timeout_s=60)
    assert await stored_texts() == texts
    stats = store.stats()
    assert (stats["published"], stats["inline_writes"], stats["landed"], stats["breaker_trips"]) == (
        50,
        0,
        50,
        0,
    )
    # Delivery is at least once (a redelivery is a no-op upsert); the rows above are exact.
    assert all(f"PERSIST-START {pid}" in worker.output() for pid in texts)


async def test_a_continuation_right_after_its_parent_never_sees_a_false_404(
    user, workers, make_store, redis_url
):
    """PER-2: a read sent the moment its parent was recorded waits for the worker's write."""
    await workers.start()
    store = make_store(redis_url, wait_s=10.0)
    for i in range(20):
        [(public_id, text)] = record_many(store, user.pk, 1, f"parent {i}").items()
        row = await store.fetch(public_id=public_id, owner_id=user.pk)
        assert row.output_text == text
    assert store.stats()["published"] == 20


@pytest.mark.parametrize(
    ("knob", "marker"),
    [
        pytest.param("MLXHOST_TEST_PERSIST_DELAY_S", "PERSIST-START", id="killed-before-the-write"),
        pytest.param("MLXHOST_TEST_PERSIST_DELAY_AFTER_S", "PERSIST-WRITTEN", id="killed-after-the-write"),
    ],
)
async def test_a_worker_killed_mid_task_still_gives_one_row_per_response(
    user, workers, make_store, redis_url, knob, marker
):
    """PER-1: SIGKILL a worker in the middle of a persist; after a restart the unacked task is
    redelivered (acks_late) and the idempotent upsert leaves exactly one row per response."""
    # A lost worker's unacked task comes back after the visibility timeout: 2 s here, not an hour.
    slow = await workers.start(**{knob: "60"}, MLXHOST_CELERY_VISIBILITY_TIMEOUT_S="2")
    store = make_store(redis_url)
    texts = record_many(store, user.pk, 3, "killed")
    first = next(iter(texts))
    await slow.wait_for(f"{marker} {first}")
    slow.kill()
    fresh = await workers.start(MLXHOST_CELERY_VISIBILITY_TIMEOUT_S="2")
    assert await store.wait_idle(timeout_s=90)
    assert await stored_texts() == texts
    await fresh.wait_for(f"PERSIST-START {first}")  # redelivered to the new worker, not lost
    assert store.stats()["inline_writes"] == 0


def via(proxy, redis_url: str) -> str:
    return urlunparse(urlparse(redis_url)._replace(netloc=f"127.0.0.1:{proxy.port}"))


async def test_broker_down_writes_inline_and_nothing_twice_when_it_returns(
    user, workers, make_store, redis_url, redis_proxy, queue
):
    """PER-3: with the broker stopped, rows are written inline within the publish bound; with it
    hanging, the publish times out and the row is written inline even though the task reaches the
    worker later; once it is back, tasks go through Celery again. 0 duplicates in the end."""
    # The worker talks to Redis directly; only the web side goes through the proxy.
    worker = await workers.start()
    store = make_store(via(redis_proxy, redis_url), publish_timeout_s=1.0)
    texts = record_many(store, user.pk, 5, "before")
    assert await store.wait_idle(timeout_s=30)
    assert store.stats()["published"] == 5

    redis_proxy.stop()
    started = time.monotonic()
    texts |= record_many(store, user.pk, 5, "stopped")
    assert await store.wait_idle(timeout_s=10)
    assert time.monotonic() - started < 5.0
    stats = store.stats()
    assert (stats["published"], stats["inline_writes"]) == (5, 5)

    redis_proxy.start()
    texts |= record_many(store, user.pk, 5, "back")
    assert await store.wait_idle(timeout_s=30)
    assert store.stats()["published"] == 10

    redis_proxy.pause()
    hung = record_many(store, user.pk, 1, "hanging")
    texts |= hung
    started = time.monotonic()
    assert await store.wait_idle(timeout_s=10)
    assert time.monotonic() - started < 5.0
    assert store.stats()["inline_writes"] == 6
    redis_proxy.resume()
    # The held publish reaches Redis after all: the worker runs it and finds the inline row.
    [hung_id] = hung
    await worker.wait_for(f"PERSIST-WRITTEN {hung_id}", timeout=15)

    queue_drained(redis_url, queue)
    assert await stored_texts() == texts
    assert len(texts) == 16


async def test_breaker_tombstone_is_swept_by_the_worker_once_the_late_row_lands(
    user, workers, make_store, redis_url, queue
):
    """PER-4 / REG-7: a persist stuck in the worker past the hard timeout trips the breaker and
    leaves a tombstone; the worker's row lands late, and the worker's tombstone sweep deletes it."""
    from mlxhost.celery import app
    from models_app.models import InstanceTombstone

    await workers.start(MLXHOST_TEST_PERSIST_DELAY_S="2")
    store = make_store(redis_url, hard_timeout_s=0.5)
    calls: list[str] = []
    record = make_record(user.pk, text="Late but kept.")
    store.record(
        record,
        on_settled=lambda: calls.append("settled"),
        on_force_release=lambda: calls.append("force_release"),
        on_late_landing=lambda: calls.append("late_landing"),
    )
    tombstones = off_loop(
        lambda: list(InstanceTombstone.objects.values_list("response_public_id", flat=True))
    )
    await eventually(lambda: calls == ["force_release", "late_landing"], timeout=30, interval=0.05)
    assert await tombstones() == [record.public_id]
    assert (await stored_texts())[record.public_id] == "Late but kept."

    with app.connection_for_write(redis_url) as connection:
        app.send_task("models_app.tasks.tombstones_purge", queue=queue, connection=connection)

    async def swept() -> bool:
        return not await tombstones()

    await eventually(swept, timeout=30, interval=0.05, what="the worker to sweep the tombstone")
