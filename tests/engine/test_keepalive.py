"""Keep-alive, the memory budget and the shutdown drain, with the fake backend and a fake clock."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from mlxhost.engine import Delta, Done, DrainingError, Started
from mlxhost.engine.backends.fake import FakeModel
from tests.engine.conftest import collect, lane_idle, lane_of, next_event, request, spec, until

KEEP_ALIVE_S = 60.0
_ids = itertools.count(1)


def kept(instance_id: int = 1, **overrides):
    """A spec whose alias frees it after KEEP_ALIVE_S idle seconds unless told otherwise."""
    overrides.setdefault("keep_alive_s", KEEP_ALIVE_S)
    return spec(instance_id, **overrides)


async def run(engine, instance_id: int = 1, request_id: str | None = None, **spec_overrides) -> Done:
    """One request to `instance_id` under the binding `alias-<id>`, collected to its Done."""
    rid = request_id or f"req-{instance_id}-{next(_ids)}"
    req = request(
        rid, binding=f"alias-{instance_id}", spec_=kept(instance_id, **spec_overrides), max_tokens=2
    )
    events = await collect(await engine.submit(req))
    assert isinstance(events[-1], Done), events
    await lane_idle(engine, instance_id)
    return events[-1]


@pytest.fixture
def clocked(make_engine, fake_clock):
    """An engine on the fake clock (lanes, keep-alive and idle times all read it)."""
    return lambda **config: make_engine(clock=fake_clock, **config)


# Keep-alive --------------------------------------------------------------------------------------


async def test_an_idle_instance_unloads_once_after_its_keep_alive_and_not_before(
    clocked, backend, fake_clock
):
    """OPS-3: idle for the keep-alive frees the weights, once; one second earlier nothing happens."""
    engine = clocked()
    await run(engine)
    model = engine.get(1).model
    fake_clock.advance(KEEP_ALIVE_S - 1)
    assert await engine.unload_idle() == []
    assert engine.get(1).state == "ready"
    fake_clock.advance(1)
    assert await engine.unload_idle() == [1]
    assert engine.get(1).state == "unloaded"
    assert engine.get(1).model is None
    assert isinstance(model, FakeModel) and model.closed
    fake_clock.advance(10 * KEEP_ALIVE_S)
    assert await engine.unload_idle() == []  # already unloaded: never twice
    assert engine.stats.unloads == {1: {"keep_alive": 1, "memory_budget": 0}}
    assert engine.registry.names() == ["alias-1"]  # still registered: same id next time (REG-3)


async def test_the_next_request_after_a_keep_alive_unload_loads_again(clocked, backend, fake_clock):
    """OPS-3, LANE-3: the request after an unload waits for a reload and then runs; one more load."""
    engine = clocked()
    await run(engine)
    assert backend.loads == [1]
    fake_clock.advance(KEEP_ALIVE_S)
    assert await engine.unload_idle() == [1]
    done = await run(engine)
    assert done.finish_reason == "length"
    assert backend.loads == [1, 1]
    assert engine.get(1).instance_id == 1
    assert engine.get(1).state == "ready"


async def test_the_keep_alive_counts_from_the_last_request_end_not_its_start(clocked, backend, fake_clock):
    """OPS-3: a request that runs longer than the keep-alive does not leave an instance "idle" at its end."""
    engine = clocked()
    backend.gated = True
    generation = await engine.submit(request("long", binding="alias-1", spec_=kept(1), max_tokens=1))
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    fake_clock.advance(10 * KEEP_ALIVE_S)
    assert await engine.unload_idle() == []  # busy: never unloaded under a running request
    backend.gated = False
    backend.gate.set()
    assert [e for e in [event async for event in stream] if isinstance(e, Done)]
    await lane_idle(engine)
    fake_clock.advance(KEEP_ALIVE_S - 1)
    assert await engine.unload_idle() == []
    fake_clock.advance(1)
    assert await engine.unload_idle() == [1]


async def test_a_pinned_alias_never_unloads_for_idleness(clocked, backend, fake_clock):
    """OPS-3: pinned aliases stay resident however long they idle."""
    engine = clocked()
    await run(engine, pinned=True)
    fake_clock.advance(1_000_000)
    assert await engine.unload_idle() == []
    assert engine.get(1).state == "ready"
    assert backend.loads == [1]


async def test_no_keep_alive_means_never(clocked, fake_clock):
    """OPS-3: keep_alive_s None (the alias's empty field) never unloads for idleness."""
    engine = clocked()
    await run(engine, keep_alive_s=None)
    fake_clock.advance(1_000_000)
    assert await engine.unload_idle() == []


async def test_an_instance_shared_by_a_pinned_alias_stays(clocked, fake_clock):
    """OPS-3, REG-2: one pinned alias of an instance keeps it resident for all its aliases."""
    engine = clocked()
    engine.bind("pinned-alias", kept(1, pinned=True))
    await run(engine)  # through the unpinned "alias-1", which re-binds the same weights last
    fake_clock.advance(10 * KEEP_ALIVE_S)
    assert await engine.unload_idle() == []
    engine.unbind("pinned-alias")
    assert await engine.unload_idle() == [1]


async def test_an_instance_of_several_aliases_waits_for_the_longest_keep_alive(clocked, fake_clock):
    """OPS-3, REG-2: two aliases of one instance: it stays until the longer keep-alive has passed."""
    engine = clocked()
    engine.bind("patient", kept(1, keep_alive_s=2 * KEEP_ALIVE_S))
    await run(engine)  # "alias-1" keeps it KEEP_ALIVE_S
    fake_clock.advance(2 * KEEP_ALIVE_S - 1)
    assert await engine.unload_idle() == []
    fake_clock.advance(1)
    assert await engine.unload_idle() == [1]


async def test_a_request_arriving_during_the_unload_waits_under_its_permit_and_reloads(
    clocked, backend, fake_clock, monkeypatch
):
    """OPS-3, LANE-3, LANE-4: the unload is a lane writer; a request that arrives meanwhile holds a
    permit while it waits, then loads the weights again and runs."""
    engine = clocked()
    await run(engine)
    closing, release = threading.Event(), threading.Event()
    original_close = FakeModel.close

    def slow_close(model: FakeModel) -> None:
        closing.set()
        release.wait(10)
        original_close(model)

    monkeypatch.setattr(FakeModel, "close", slow_close)
    fake_clock.advance(KEEP_ALIVE_S)
    unloading = asyncio.create_task(engine.unload_idle())
    await until(closing.is_set, what="the unload to reach the worker")
    submitted = asyncio.create_task(
        engine.submit(request("during", binding="alias-1", spec_=kept(1), max_tokens=2))
    )
    await until(lambda: lane_of(engine)["permits"] == 1, what="the arrival to hold a permit")
    assert lane_of(engine)["writers"] >= 1
    release.set()
    assert await unloading == [1]
    events = await collect(await submitted)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "length"
    assert backend.loads == [1, 1]


async def test_housekeeping_unloads_idle_instances_on_its_own(clocked, fake_clock):
    """OPS-3: the housekeeping loop applies the keep-alive without anyone calling unload_idle."""
    engine = clocked(housekeeping_interval_s=0.01)
    await run(engine)
    task = asyncio.create_task(engine.housekeeping())
    try:
        fake_clock.advance(KEEP_ALIVE_S)
        await until(lambda: 1 in engine.stats.unloads, what="housekeeping to unload")
    finally:
        task.cancel()
    assert engine.stats.unloads[1]["keep_alive"] == 1
    assert engine.get(1).state == "unloaded" and engine.get(1).model is None


# Memory budget -----------------------------------------------------------------------------------

FAKE_MODEL_BYTES = 1024  # FakeModel.memory_bytes()


async def test_loading_over_the_budget_evicts_the_least_recently_used_idle_instance(
    clocked, backend, fake_clock
):
    """OPS-3: over the memory budget, the least recently used unpinned idle instance goes first."""
    engine = clocked(memory_budget_bytes=2 * FAKE_MODEL_BYTES)
    await run(engine, 1)
    fake_clock.advance(1)
    await run(engine, 2)
    fake_clock.advance(1)
    await run(engine, 1)  # 2 is now the least recently used
    fake_clock.advance(1)
    await run(engine, 3)  # never loaded before: measured after its load, then 2 makes room
    assert [engine.get(i).state for i in (1, 2, 3)] == ["ready", "unloaded", "ready"]
    assert engine.resident_bytes() == 2 * FAKE_MODEL_BYTES
    assert engine.stats.unloads[2] == {"keep_alive": 0, "memory_budget": 1}

    states_at_load: list[list[bool]] = []
    original_load = backend.load

    def recording_load(spec_, progress):
        states_at_load.append([engine.get(i).model is not None for i in (1, 2, 3)])
        return original_load(spec_, progress)

    backend.load = recording_load  # type: ignore[method-assign]
    fake_clock.advance(1)
    await run(engine, 2)  # its size is known now: 1 (used before 3) is evicted before the load
    assert states_at_load == [[False, False, True]]
    assert [engine.get(i).state for i in (1, 2, 3)] == ["unloaded", "ready", "ready"]
    assert backend.loads == [1, 2, 3, 2]
    assert engine.stats.unloads[1] == {"keep_alive": 0, "memory_budget": 1}


async def test_the_budget_never_evicts_a_pinned_or_busy_instance(clocked, backend, fake_clock):
    """OPS-3: pinned and busy instances stay; with nothing evictable the load goes ahead anyway."""
    engine = clocked(memory_budget_bytes=2 * FAKE_MODEL_BYTES)
    await run(engine, 1, pinned=True)  # the least recently used, but pinned
    fake_clock.advance(1)
    await run(engine, 2)
    fake_clock.advance(1)
    await run(engine, 3)
    assert [engine.get(i).state for i in (1, 2, 3)] == ["ready", "unloaded", "ready"]

    backend.gated = True
    busy = await engine.submit(request("busy", binding="alias-3", spec_=kept(3), max_tokens=1))
    stream = busy.stream()
    assert isinstance(await next_event(stream), Started)  # 3 holds a running request
    fake_clock.advance(1)
    await engine.load(kept(4), name="alias-4")  # over budget, nothing evictable: loads anyway
    assert [engine.get(i).state for i in (1, 2, 3, 4)] == ["ready", "unloaded", "ready", "ready"]
    assert engine.resident_bytes() == 3 * FAKE_MODEL_BYTES
    assert backend.loads == [1, 2, 3, 4]
    backend.gated = False
    backend.gate.set()
    assert isinstance([e async for e in stream][-1], Done)


async def test_without_a_budget_nothing_is_evicted(clocked, backend, fake_clock):
    """OPS-3: the memory budget is optional; without it loads never evict."""
    engine = clocked()
    for instance_id in (1, 2, 3):
        await run(engine, instance_id, keep_alive_s=None)
        fake_clock.advance(1)
    assert [engine.get(i).state for i in (1, 2, 3)] == ["ready"] * 3
    assert engine.stats.unloads == {}


# Shutdown drain ----------------------------------------------------------------------------------


async def test_shutdown_refuses_arrivals_as_draining_and_ends_running_streams(make_engine, backend):
    """OPS-5, LANE-7: while shutdown drains, arrivals get DrainingError and queued requests fail with
    it; a running stream that outlives the timeout is aborted and still ends with a Done; then the
    engine is closed."""
    engine = make_engine(shutdown_timeout_s=0.2)
    backend.gated = True
    running = await engine.submit(request("running", max_tokens=100_000))
    stream = running.stream()
    assert isinstance(await next_event(stream), Started)
    queued = await engine.submit(request("queued", max_tokens=2))
    backend.gated = False
    backend.gate.set()
    stopping = asyncio.create_task(engine.shutdown())
    await until(lambda: lane_of(engine)["draining"], what="the drain to start")
    with pytest.raises(DrainingError):
        await engine.submit(request("late", max_tokens=2))
    with pytest.raises(DrainingError):
        await queued.admitted()
    events = [event async for event in stream]
    assert any(isinstance(e, Delta) for e in events)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "aborted"  # cut short, says so
    await asyncio.wait_for(stopping, 5)
    with pytest.raises(DrainingError):  # shut down: still "draining" to a client (LANE-7, issue 25)
        await engine.submit(request("after", max_tokens=2))
    assert engine.stats.requests()[0][2].rejected == {"queue_full": 0, "draining": 3, "queue_timeout": 0}
