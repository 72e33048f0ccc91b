"""Persistence: idempotent upsert, eager and inline writes, pending waits, tenancy, retention, breaker."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from mlxhost.engine import Engine, EngineConfig
from mlxhost.engine.backends.fake import FakeBackend
from mlxhost.runtime import PROCESS
from models_app.catalogue import services
from models_app.models import InstanceTombstone, StoredResponse
from models_app.persistence import persistence as persistence_module
from models_app.persistence import tasks
from models_app.persistence.persistence import Persistence, ResponseRecord, StorageTimeoutError
from models_app.persistence.publishing import CeleryPublisher
from tests.engine.conftest import spec
from tests.models_app.support import build_persistence, drop, make_record, off_loop
from tests.support import FakeClock, eventually

DAY = 24 * 3600


@pytest.fixture
def make_store():
    """Build a `Persistence` with test timings, installed as the process one, closed afterwards."""
    built: list[Persistence] = []

    def build(**options) -> Persistence:
        options.setdefault("poll_s", 0.02)
        options.setdefault("wait_s", 2.0)
        store = build_persistence(**options)
        PROCESS.put(persistence_module.PERSISTENCE, store)
        built.append(store)
        return store

    yield build
    for store in built:
        store.close()
    PROCESS.put(persistence_module.PERSISTENCE, None)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


rows = off_loop(lambda **filters: list(StoredResponse.objects.filter(**filters)))


# Services and tasks (synchronous) ---------------------------------------------------------------


@pytest.mark.django_db
def test_persist_task_is_an_idempotent_upsert(user):
    """PER-1: the persist task is keyed by the response id; running it twice leaves one row."""
    record = make_record(user.pk, text="Once only.")
    tasks.response_persist.apply(args=[record.as_payload()], throw=True)
    tasks.response_persist.apply(args=[record.as_payload()], throw=True)
    services.response_persist(payload=record.as_payload())
    [row] = StoredResponse.objects.all()
    assert (row.public_id, row.output_text, row.status) == (record.public_id, "Once only.", "completed")
    assert (row.instance_id, row.weights_fingerprint, row.boot_id) == (7, "f" * 64, "b" * 32)  # REG-4
    assert row.created_at == datetime.fromtimestamp(record.created_at, tz=UTC)


@pytest.mark.django_db
def test_persist_of_a_deleted_owner_or_alias_is_safe(user, tiny_alias, django_user_model):
    gone = django_user_model.objects.create_user(username="gone")
    orphan = make_record(gone.pk)
    gone.delete()
    assert services.response_persist(payload=orphan.as_payload()) is None
    record = make_record(user.pk, alias_id=tiny_alias.pk)
    tiny_alias.delete()
    row = services.response_persist(payload=record.as_payload())
    assert (row.alias_id, row.alias_name) == (None, "tiny")
    assert StoredResponse.objects.count() == 1


@pytest.mark.parametrize(
    ("retention_s", "kept_s"),
    [
        pytest.param(None, 7 * DAY, id="default-7-days"),
        pytest.param(0, 7 * DAY, id="zero-is-default"),
        pytest.param(5, 60, id="clamped-up-to-60s"),
        pytest.param(3600, 3600, id="in-range"),
        pytest.param(10**9, 30 * DAY, id="clamped-down-to-30-days"),
    ],
)
@pytest.mark.django_db
def test_retention_is_bounded(user, retention_s, kept_s):
    """PER-5: rows expire after the default or a per-request override clamped to [60 s, 30 days]."""
    record = make_record(user.pk, retention_s=retention_s)
    row = services.response_persist(payload=record.as_payload())
    assert row.expires_at - row.created_at == timedelta(seconds=kept_s)


@pytest.mark.django_db
def test_purge_tasks_twice_reach_the_same_end_state(user):
    """PER-5: expired rows and stale tombstones go; running the sweeps twice changes nothing more."""
    live = services.response_persist(payload=make_record(user.pk).as_payload())
    old = services.response_persist(
        payload=make_record(user.pk, created_at=time.time() - 120, retention_s=60).as_payload()
    )
    key = ("/models/fake-1", "", "f" * 64)
    landed = services.tombstone_record(instance_id=7, weights_key=key, public_id=live.public_id)
    waiting = services.tombstone_record(instance_id=7, weights_key=key, public_id="resp_not_landed")
    expired = services.tombstone_record(instance_id=7, weights_key=key, public_id="resp_never")
    InstanceTombstone.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    for _ in range(2):
        tasks.responses_purge_expired.apply(throw=True)
        tasks.tombstones_purge.apply(throw=True)
        assert list(StoredResponse.objects.values_list("public_id", flat=True)) == [live.public_id]
        assert list(InstanceTombstone.objects.values_list("pk", flat=True)) == [waiting.pk]
    assert not StoredResponse.objects.filter(pk=old.pk).exists()
    assert landed.pk != waiting.pk


def test_record_rejects_a_non_terminal_status():
    with pytest.raises(ValueError, match="pending"):
        make_record(1, status="pending")
    assert make_record(1, weights_key=["a", "", "f"]).as_payload()["weights_key"] == ["a", "", "f"]


# The web-process side (on the event loop) -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_eager_default_writes_the_row_and_settles(user, make_store):
    """PER-1: without a broker the task runs eagerly, in a thread, after the answer; then settles."""
    store = make_store()  # eager: follows task_always_eager, True in the test settings
    settled = []
    record = make_record(user.pk, text="Eager.")
    store.record(record, on_settled=lambda: settled.append(record.public_id))
    assert store.pending_count() == 1  # recorded now, written off the loop
    assert await store.wait_idle(timeout_s=5)
    assert settled == [record.public_id]
    [row] = await rows()
    assert row.output_text == "Eager."
    stats = store.stats()
    assert (stats["eager_writes"], stats["landed"], stats["published"], stats["pending"]) == (1, 1, 0, 0)


@pytest.mark.django_db(transaction=True)
async def test_broker_down_writes_inline_within_the_publish_bound(user, make_store, celery_publishes):
    """PER-3: a broker that refuses connections costs a bounded publish, then the row is written inline."""
    url = f"redis://127.0.0.1:{closed_port()}/5"
    store = make_store(publish=CeleryPublisher(timeout_s=1.0, url=url), publish_timeout_s=1.0)
    records = [make_record(user.pk, text=f"inline {i}") for i in range(3)]
    started = time.monotonic()
    for record in records:
        store.record(record)
    assert await store.wait_idle(timeout_s=5)
    assert time.monotonic() - started < 4.0  # refused at once; each publish is bounded by 1 s anyway
    assert sorted(row.output_text for row in await rows()) == ["inline 0", "inline 1", "inline 2"]
    stats = store.stats()
    assert (stats["publish_failures"], stats["inline_writes"], stats["published"]) == (3, 3, 0)


@pytest.mark.django_db(transaction=True)
async def test_a_hanging_publish_times_out_and_writes_inline(user, make_store):
    """PER-3: a publish that hangs (a blackholed broker) is abandoned after the publish timeout."""
    release = threading.Event()
    store = make_store(eager=False, publish=lambda payload: release.wait(10), publish_timeout_s=0.2)
    record = make_record(user.pk)
    started = time.monotonic()
    store.record(record)
    try:
        assert await store.wait_idle(timeout_s=5)
        assert time.monotonic() - started < 3.0  # the publish never returns (10 s)
        assert [row.public_id for row in await rows()] == [record.public_id]
        assert store.stats()["inline_writes"] == 1
    finally:
        release.set()


@pytest.mark.django_db(transaction=True)
async def test_fetch_waits_for_a_pending_write(user, make_store):
    """PER-2: a read that arrives before the row landed waits for it instead of answering 404."""
    store = make_store(eager=False, publish=drop)
    record = make_record(user.pk, text="Landed late.")
    store.record(record)

    async def worker_lands_it():
        await asyncio.sleep(0.3)  # the thing under test: the row lands late, while fetch waits
        await off_loop(services.response_persist)(payload=record.as_payload())

    landing = asyncio.create_task(worker_lands_it())
    started = time.monotonic()
    row = await store.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=5)
    assert row.output_text == "Landed late."
    assert 0.25 < time.monotonic() - started < 3
    await landing
    assert store.pending_count() == 0


@pytest.mark.django_db(transaction=True)
async def test_fetch_of_a_pending_write_past_the_wait_is_a_storage_timeout(user, make_store):
    """PER-2: still not landed after the wait: StorageTimeoutError (503 storage_timeout), never 404."""
    store = make_store(eager=False, publish=drop)
    record = make_record(user.pk)
    store.record(record)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError):
        await store.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=0.3)
    assert 0.3 <= time.monotonic() - started < 2


@pytest.mark.django_db(transaction=True)
async def test_a_row_read_then_deleted_before_the_monitor_saw_it_is_missing_not_pending(user, make_store):
    """PER-2: a read that finds the row settles the pending write, so a delete right after it
    leaves a 404, not a 503 storage_timeout for a row that did land (the monitor never saw it)."""
    store = make_store(eager=False, publish=drop, poll_s=60)  # the monitor does not tick here
    record = make_record(user.pk)
    store.record(record)
    await off_loop(services.response_persist)(payload=record.as_payload())  # the worker's write
    row = await store.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=2)
    assert store.pending_count() == 0
    await off_loop(services.response_delete)(public_id=row.public_id, owner_id=user.pk)
    started = time.monotonic()
    with pytest.raises(StoredResponse.DoesNotExist):
        await store.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=2)
    assert time.monotonic() - started < 1.5


@pytest.mark.django_db(transaction=True)
async def test_another_tenants_id_is_exactly_a_missing_one(user, make_store, django_user_model):
    """PER-6: another tenant's id, landed or still pending, reads as missing, without waiting."""
    other = await off_loop(django_user_model.objects.create_user)(username="bob")
    store = make_store(eager=False, publish=drop)
    pending = make_record(user.pk)
    store.record(pending)
    landed = make_record(user.pk)
    await off_loop(services.response_persist)(payload=landed.as_payload())
    for public_id in (pending.public_id, landed.public_id, "resp_missing"):
        started = time.monotonic()
        with pytest.raises(StoredResponse.DoesNotExist):
            await store.fetch(public_id=public_id, owner_id=other.pk, wait_s=2)
        assert time.monotonic() - started < 1.5  # no wait (wait_s=2), so no timing tell either
    with pytest.raises(StoredResponse.DoesNotExist):
        await store.fetch(public_id="resp_missing", owner_id=user.pk)
    assert (await store.fetch(public_id=landed.public_id, owner_id=user.pk)).pk


# The breaker (PER-4, REG-7) ----------------------------------------------------------------------


@pytest.fixture
async def fake_engine():
    backend = FakeBackend()
    engine = Engine(EngineConfig(backend="fake"), backend=backend)
    yield engine
    backend.gated = False
    backend.gate.set()
    await engine.shutdown()


@pytest.mark.django_db(transaction=True)
async def test_breaker_releases_a_wedged_persist_and_tombstones_the_id(user, make_store, fake_engine):
    """PER-4 / REG-7: a hung persist trips the breaker after the hard timeout: the retention is
    released, a tombstone row is recorded, a re-register of the same weights inherits the id, and
    when the row finally lands the tombstone is released and the cleanup task deletes it."""
    engine = fake_engine
    store = make_store(eager=False, publish=drop, hard_timeout_s=0.3)
    instance = engine.bind("a", spec(1))
    engine.registry.retain(instance)
    weights_key = instance.spec.weights_key
    record = make_record(
        user.pk, instance_id=instance.instance_id, weights_key=list(weights_key), text="Wedged."
    )
    calls: list[str] = []

    def force_release() -> None:
        calls.append("force_release")
        engine.registry.retire_for_force_release(instance)

    def late_landing() -> None:
        calls.append("late_landing")
        engine.registry.release_tombstone(weights_key)

    store.record(
        record,
        on_settled=lambda: calls.append("settled"),
        on_force_release=force_release,
        on_late_landing=late_landing,
    )
    await eventually(lambda: calls == ["force_release"], timeout=3, what="the breaker")
    assert store.stats()["breaker_trips"] == 1
    assert store.pending_count() == 0 and store.is_pending(record.public_id)
    await until_tombstone_row(record.public_id)
    [tombstone] = await off_loop(list)(InstanceTombstone.objects.all())
    assert (tombstone.instance_id, tombstone.source, tombstone.fingerprint) == (
        1,
        weights_key[0],
        weights_key[2],
    )

    # The alias goes away and the same weights come back under a fresh candidate id: the late
    # row stays chainable because the retired id is inherited (REG-7).
    engine.unbind("a")
    revived = engine.bind("a", spec(5, source=weights_key[0]))
    assert revived.instance_id == 1
    # A continuation of the wedged response still waits, then hears "retry", not 404 (PER-2).
    with pytest.raises(StorageTimeoutError):
        await store.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=0.1)

    await off_loop(tasks.response_persist.apply)(args=[record.as_payload()], throw=True)
    await eventually(lambda: calls == ["force_release", "late_landing"], timeout=3, what="the late landing")
    assert engine.registry.tombstone(weights_key) is None
    assert store.stats()["late_landed"] == 1 and not store.is_pending(record.public_id)
    row = await store.fetch(public_id=record.public_id, owner_id=user.pk)
    assert (row.output_text, row.instance_id) == ("Wedged.", 1)
    purged = await off_loop(tasks.tombstones_purge.apply)(throw=True)
    assert purged.get() == 1
    assert not await off_loop(InstanceTombstone.objects.exists)()


async def until_tombstone_row(public_id: str) -> None:
    tombstoned = off_loop(InstanceTombstone.objects.filter(response_public_id=public_id).exists)
    await eventually(tombstoned, timeout=3, interval=0.02, what=f"a tombstone row for {public_id}")


@pytest.mark.django_db(transaction=True)
async def test_an_unlanded_tombstone_expires_and_is_released(user, make_store):
    """REG-7: a wedged persist that never lands releases its tombstone when it expires."""
    store = make_store(eager=False, publish=drop, hard_timeout_s=0.1, tombstone_ttl_s=0.2)
    calls: list[str] = []
    store.record(
        make_record(user.pk),
        on_force_release=lambda: calls.append("force_release"),
        on_late_landing=lambda: calls.append("late_landing"),
    )
    await eventually(lambda: calls == ["force_release", "late_landing"], timeout=3, what="expiry")
    assert store.stats()["tombstones_expired"] == 1


@pytest.mark.django_db(transaction=True)
async def test_given_up_writes_keep_no_record_and_are_bounded(user, make_store):
    """PER-4, REG-7 (issue 25): a trip keeps only what a late landing needs (no record, so none of
    its text), and at most `late_limit` given-up writes are watched: beyond it, the oldest is given
    up as if its tombstone expired (its tombstone is released)."""
    store = make_store(eager=False, publish=drop, hard_timeout_s=0.05, tombstone_ttl_s=3600, late_limit=3)
    released: list[int] = []
    records = [make_record(user.pk, text="x" * 100_000) for _ in range(5)]
    for i, record in enumerate(records):
        store.record(record, on_late_landing=functools.partial(released.append, i))
    await eventually(lambda: store.stats()["breaker_trips"] == 5, timeout=5, what="five trips")
    assert store.stats()["late"] == 3 and store.stats()["tombstones_expired"] == 2
    assert sorted(released) == [0, 1]  # the oldest two
    assert [store.is_pending(r.public_id) for r in records] == [False, False, True, True, True]
    held = [getattr(late, name) for late in store._late.values() for name in late.__slots__]
    assert not any(isinstance(value, ResponseRecord | dict | str) for value in held)
    assert await store.flush(timeout_s=5)  # the tombstone rows are written before the next test


@pytest.mark.django_db(transaction=True)
async def test_given_up_writes_are_looked_for_ever_more_rarely(user, make_store, monkeypatch):
    """PER-4 (issue 25): the monitor looks for a given-up write's late row at a doubling interval,
    up to once a minute, not at every 0.25 s poll: over a 2-hour tombstone, 20 trips cost a few
    thousand ids looked up in all (576,000 before), and then expire."""
    clock = FakeClock()
    store = make_store(
        eager=False, publish=drop, hard_timeout_s=1, poll_s=0.25, tombstone_ttl_s=7200, clock=clock
    )
    looked_up: list[str] = []

    def landed(*, public_ids):
        looked_up.extend(public_ids)
        return set()

    monkeypatch.setattr(persistence_module.selectors, "responses_landed", landed)
    for _ in range(20):
        store.record(make_record(user.pk))
    await eventually(lambda: store.stats()["published"] == 20, timeout=5, what="the publishes")
    store._monitor.cancel()  # this test ticks the monitor itself, on its own clock
    clock.advance(2)
    await store._tick()
    assert store.stats()["breaker_trips"] == 20
    looked_up.clear()
    for _ in range(7200):
        clock.advance(1)
        await store._tick()
    assert store.stats()["tombstones_expired"] == 20 and store.stats()["late"] == 0
    per_write = len(looked_up) / 20
    assert 7200 / 60 <= per_write <= 7200 / 60 + 12  # about once a minute, after a short ramp
    assert await store.flush(timeout_s=5)


@pytest.mark.django_db(transaction=True)
async def test_embedded_default_sweeps_in_the_web_process(user, make_store):
    """PER-5: without a broker (no beat) the web process purges expired rows and stale tombstones."""
    store = make_store(sweep_interval_s=0.05)
    expired = make_record(user.pk, created_at=time.time() - 120, retention_s=60)
    await off_loop(services.response_persist)(payload=expired.as_payload())
    await off_loop(services.tombstone_record)(
        instance_id=7, weights_key=expired.weights_key, public_id=expired.public_id
    )
    monitor = asyncio.create_task(store.run_monitor())
    sweeper = asyncio.create_task(store.run_sweeper())
    await asyncio.sleep(0)
    await asyncio.wait_for(store.run_monitor(), 1)  # one per loop: a second call returns at once
    await asyncio.wait_for(store.run_sweeper(), 1)

    async def swept() -> bool:
        exists = off_loop(StoredResponse.objects.exists), off_loop(InstanceTombstone.objects.exists)
        return not any([await exists[0](), await exists[1]()])

    await eventually(swept, timeout=3, interval=0.02, what="the embedded sweep")
    assert not monitor.done() and not sweeper.done()
    monitor.cancel()
    sweeper.cancel()


async def test_server_start_runs_one_monitor_and_the_embedded_sweeper(make_store):
    """PER-4 / PER-5: starting the server starts the breaker's monitor and, without a broker, the
    sweeper; a second start, or a record, adds no second one."""
    from models_app.persistence.lifecycle import start_persistence

    store = make_store()
    start_persistence()
    start_persistence()

    def names() -> list[str]:
        return sorted(
            task.get_name() for task in asyncio.all_tasks() if task.get_name().startswith("persist-")
        )

    # The second start's monitor and sweeper return at once; the first ones keep running.
    await eventually(lambda: names() == ["persist-monitor", "persist-sweeper"], what="one of each task")
    store.close()


# Pending writes across hosts (issue 15) ----------------------------------------------------------


@pytest.fixture
def shared_redis():
    """A SharedPending on the real Redis (REDIS_URL, else the machine's own), under a key prefix of
    this test's, cleared afterwards."""
    import os
    import uuid

    from django.core.cache.backends.redis import RedisCache

    from models_app.persistence.persistence import SharedPending

    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    cache = RedisCache(url, {"KEY_PREFIX": f"test-{uuid.uuid4().hex}"})
    yield SharedPending(cache)
    cache.clear()


@pytest.mark.django_db(transaction=True)
async def test_another_host_waits_for_a_write_pending_on_this_one(user, make_store, shared_redis):
    """OPS-9: host B sees host A's pending write through Redis and waits for the row, never 404."""
    host_a = make_store(eager=False, publish=drop, shared=shared_redis)
    host_b = make_store(eager=False, publish=drop, shared=shared_redis)
    record = make_record(user.pk, text="Written by A.")
    await host_a.record(record)  # the handoff: shared before the client hears the turn is over

    async def worker_lands_it():
        await asyncio.sleep(0.3)  # the thing under test: the row lands late, while B waits
        await off_loop(services.response_persist)(payload=record.as_payload())

    landing = asyncio.create_task(worker_lands_it())
    row = await host_b.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=5)
    assert row.output_text == "Written by A."
    await landing
    await eventually(lambda: shared_redis.owner(record.public_id) is None)  # A saw it land, cleared it


@pytest.mark.django_db(transaction=True)
async def test_another_hosts_pending_write_past_the_wait_is_a_storage_timeout(user, make_store, shared_redis):
    host_a = make_store(eager=False, publish=drop, shared=shared_redis)
    host_b = make_store(eager=False, publish=drop, shared=shared_redis)
    record = make_record(user.pk)
    await host_a.record(record)
    with pytest.raises(StorageTimeoutError):
        await host_b.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=0.3)
    # Another tenant asking for the same id is told it is missing, as for any id (PER-6).
    with pytest.raises(StoredResponse.DoesNotExist):
        await host_b.fetch(public_id=record.public_id, owner_id=user.pk + 1000, wait_s=0.3)


@pytest.mark.django_db(transaction=True)
async def test_without_a_shared_table_another_host_answers_missing(user, make_store):
    """The behaviour without Redis is unchanged: only the writing process knows the id is pending."""
    host_a = make_store(eager=False, publish=drop)
    host_b = make_store(eager=False, publish=drop)
    record = make_record(user.pk)
    await host_a.record(record)
    with pytest.raises(StoredResponse.DoesNotExist):
        await host_b.fetch(public_id=record.public_id, owner_id=user.pk, wait_s=0.3)
