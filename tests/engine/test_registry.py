"""The registry through the engine (REG-*): aliases share instances, hot swaps, revives, tombstones."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine import Done, LaneSettings, ModelLoadError, PromptTooLongError, Started, UnknownModelError
from tests.engine.conftest import collect, lane_idle, lane_of, next_event, request, spec, until

X = spec(1)  # weights /models/fake-1
Y = spec(2)  # other weights: /models/fake-2


def x_as(candidate_id: int, **overrides):
    """The weights of X under another caller-side instance id (a second alias row, a re-register)."""
    return spec(candidate_id, source=X.source, **overrides)


async def started(generation):
    stream = generation.stream()
    while not isinstance(await next_event(stream), Started):
        pass
    return stream


def ungate(backend) -> None:
    backend.gated = False
    backend.gate.set()


async def torn_down(instance) -> None:
    """Wait for a forgotten instance's teardown task: model freed, worker thread ended."""
    await until(
        lambda: instance.state == "unloaded" and not instance.snapshot()["worker_alive"], what="teardown"
    )
    assert instance.model is None


async def test_aliases_of_the_same_weights_share_one_instance_and_lane(engine, backend):
    """REG-2: two aliases of the same weights share one instance, one lane, one load."""
    a = engine.bind("a", X)
    b = engine.bind("b", x_as(2))
    assert b is a
    assert b.instance_id == 1
    assert b.lane is a.lane
    with pytest.raises(UnknownModelError):
        engine.get(2)

    backend.gated = True
    first = await engine.submit(request("via-a", binding="a", spec_=X, max_tokens=1))
    second = await engine.submit(request("via-b", binding="b", spec_=x_as(2), max_tokens=1))
    lane = lane_of(engine, 1)
    assert (lane["active"], lane["queued"]) == (1, 1)
    assert first.instance_id == second.instance_id == 1
    [snap] = engine.snapshot()
    assert snap["aliases"] == ["a", "b"]
    ungate(backend)
    results = await asyncio.wait_for(asyncio.gather(collect(first), collect(second)), 5)
    assert [events[-1].finish_reason for events in results] == ["length", "length"]
    assert backend.loads == [1]
    assert [instance_id for instance_id, _, _ in backend.history] == [1, 1]


async def test_hot_swap_gets_a_new_id_and_tears_the_old_instance_down(engine, backend):
    """REG-3 / REG-6: swapping an alias to other weights binds a new id; the idle old instance goes."""
    old = await engine.load(X, name="a")
    new = engine.bind("a", Y)
    assert new is not old
    assert engine.registry.resolve("a").instance_id == 2
    with pytest.raises(UnknownModelError):
        engine.get(1)
    await torn_down(old)
    events = await collect(await engine.submit(request("r1", binding="a", spec_=Y, max_tokens=1)))
    assert events[-1].finish_reason == "length"
    assert backend.loads == [1, 2]
    assert [snap["instance_id"] for snap in engine.snapshot()] == [2]


async def test_hot_swap_waits_for_the_running_request(engine, backend):
    """REG-6: a hot swap while a request runs on X leaves X up until that request finished."""
    old = await engine.load(X, name="a")
    backend.gated = True
    running = await engine.submit(request("r1", binding="a", spec_=X, max_tokens=2))
    stream = await started(running)
    engine.bind("a", Y)
    assert engine.registry.resolve("a").instance_id == 2
    assert engine.get(1) is old  # leased by the running request
    assert old.model is not None
    assert engine.registry.names_of(old) == []

    ungate(backend)
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 2
    await until(lambda: 1 not in [s["instance_id"] for s in engine.snapshot()], what="X to be forgotten")
    with pytest.raises(UnknownModelError):
        engine.get(1)
    await torn_down(old)


async def test_revive_before_teardown_keeps_id_lane_and_queue(engine, backend):
    """REG-6: unbind then re-register the same weights while a request leases X: same instance, id, lane, queue."""
    instance = await engine.load(X, name="a")
    lane = instance.lane
    backend.gated = True
    running = await engine.submit(request("r1", binding="a", spec_=X, max_tokens=1))
    stream = await started(running)
    queued = await engine.submit(request("r2", binding="a", spec_=X, max_tokens=1))
    engine.unbind("a")
    with pytest.raises(UnknownModelError):
        engine.registry.resolve("a")
    assert engine.get(1) is instance  # the lease keeps it

    revived = engine.bind("a", x_as(5))
    assert revived is instance
    assert revived.instance_id == 1
    assert revived.lane is lane
    assert lane_of(engine, 1)["queued"] == 1  # the waiter kept its place
    with pytest.raises(UnknownModelError):
        engine.get(5)

    ungate(backend)
    assert [e async for e in stream][-1].finish_reason == "length"
    events = await asyncio.wait_for(collect(queued), 5)
    assert events[-1].finish_reason == "length"
    await lane_idle(engine, 1)
    assert engine.get(1) is instance  # still bound: never torn down
    assert instance.model is not None
    assert backend.loads == [1]


async def test_pending_persist_retention_defers_teardown(engine, backend):
    """REG-6: a retained instance (pending persist) survives unbind until the retention is released."""
    instance = engine.bind("a", X)
    engine.registry.retain(instance)
    engine.unbind("a")
    assert engine.get(1) is instance
    engine.registry.unretain(instance)
    with pytest.raises(UnknownModelError):
        engine.get(1)
    await torn_down(instance)


async def test_tombstone_is_inherited_refcounted_and_released(engine, backend):
    """REG-7: a force-released id is kept in a refcounted tombstone, inherited by a re-register, then freed."""
    registry = engine.registry
    instance = engine.bind("a", X)
    registry.retain(instance)
    registry.retain(instance)
    engine.unbind("a")
    assert engine.get(1) is instance
    assert registry.retire_for_force_release(instance) == 1
    assert engine.get(1) is instance  # one retention left
    assert registry.retire_for_force_release(instance) == 1
    with pytest.raises(UnknownModelError):
        engine.get(1)
    await torn_down(instance)
    tombstone = registry.tombstone(X.weights_key)
    assert tombstone is not None
    assert (tombstone.instance_id, tombstone.outstanding) == (1, 2)

    heir = engine.bind("a", x_as(9))
    assert heir is not instance
    assert heir.instance_id == 1  # inherited, so the late-landing rows stay chainable
    assert engine.get(1) is heir
    with pytest.raises(UnknownModelError):
        engine.get(9)
    events = await collect(await engine.submit(request("r1", binding="a", spec_=x_as(9), max_tokens=1)))
    assert events[-1].finish_reason == "length"
    assert backend.history[-1][0] == 1

    registry.release_tombstone(X.weights_key)
    assert registry.tombstone(X.weights_key).outstanding == 1
    registry.release_tombstone(X.weights_key)
    assert registry.tombstone(X.weights_key) is None
    registry.release_tombstone(X.weights_key)  # a third release is a no-op
    assert registry.tombstone(X.weights_key) is None

    await lane_idle(engine, 1)
    engine.unbind("a")
    with pytest.raises(UnknownModelError):
        engine.get(1)
    await torn_down(heir)
    assert engine.bind("b", x_as(10)).instance_id == 10


async def test_rebind_updates_settings_in_place_but_running_requests_keep_theirs(engine, backend):
    """REG-5: re-binding with new lane settings applies to the next request only; a request that
    carries a lower input limit (its alias's) is held to it."""
    instance = await engine.load(X, name="a")
    lane = instance.lane
    backend.gated = True
    running = await engine.submit(request("r1", binding="a", spec_=X, max_tokens=3))
    stream = await started(running)

    updated = x_as(1, lane=LaneSettings(capacity=1, queue_depth=1))
    assert engine.bind("a", updated) is instance
    assert instance.lane is lane
    probe = lane_of(engine, 1)
    assert (probe["capacity"], probe["limit"]) == (1, 2)
    with pytest.raises(PromptTooLongError) as info:
        # Four characters may fit in five tokens; the template's tags make it too long.
        await engine.submit(request("r2", binding="a", text="abcd", max_input_tokens=5))
    assert info.value.limit == 5
    assert backend.render_calls == 2  # templated, counted, refused

    ungate(backend)
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 3  # its own max_tokens, untouched by the re-register
    assert [sampling.max_tokens for _, _, sampling in backend.history] == [3]


async def test_an_instance_id_never_names_two_weights(engine, backend):
    """REG-3: binding a spec whose instance id already names other weights raises ValueError."""
    instance = engine.bind("a", X)
    with pytest.raises(ValueError):
        engine.bind("b", spec(1, source="/models/other"))
    with pytest.raises(UnknownModelError):
        engine.registry.resolve("b")
    with pytest.raises(ValueError):
        engine.bind("a", spec(1, source="/models/other"))  # a swap onto a reused id
    assert engine.registry.resolve("a") is instance
    assert engine.get(1).spec.source == X.source


async def test_a_torn_down_instance_cannot_be_retained_after_its_id_was_inherited(engine, backend):
    """REG-7: holds are by instance, not by id; a stale handle never pins the heir of its id."""
    registry = engine.registry
    old = engine.bind("a", X)
    registry.retain(old)
    engine.unbind("a")
    registry.retire_for_force_release(old)  # last hold gone: torn down, id 1 tombstoned
    heir = engine.bind("a", x_as(9))
    assert heir is not old
    assert heir.instance_id == old.instance_id == 1
    with pytest.raises(UnknownModelError):
        registry.retain(old)
    registry.unretain(old)  # a stale release is a no-op for the heir
    assert registry.holds(heir).bindings == 1
    assert registry.holds(heir).retentions == 0


async def test_a_reload_to_new_weights_moves_every_name_only_once_they_are_resident(engine, backend):
    """OPS-4, REG-6: `reload` loads new weights beside the old instance under a staging name,
    runs `on_resident`, then moves every alias at once; a failed load leaves them all in place."""
    old = await engine.serve(["a", "b"], X)
    moved: list[int] = []

    async def on_resident() -> None:
        moved.append(engine.resolve("a"))  # still the old instance while control records the switch

    new_id = await engine.reload(["a", "b"], spec(2), on_resident=on_resident)
    assert moved == [old.instance_id]
    assert engine.resolve("a") == engine.resolve("b") == new_id == 2
    assert engine.bound_names() == ["a", "b"]  # the staging name is gone

    backend.load_failures = 1
    with pytest.raises(ModelLoadError):
        await engine.reload(["a", "b"], spec(3))
    assert engine.resolve("a") == engine.resolve("b") == 2
    assert engine.bound_names() == ["a", "b"]


async def test_a_reload_of_the_same_weights_drains_and_loads_them_in_place(engine, backend):
    """OPS-4, LANE-7: the same weights reload under the same instance id, after a drain."""
    instance = await engine.serve(["a"], X)
    assert await engine.reload(["a"], X) == instance.instance_id
    assert backend.loads == [1, 1]
    assert engine.resolve("a") == instance.instance_id and instance.state == "ready"


async def test_a_reload_of_the_same_weights_keeps_arrivals_waiting_in_the_lane(engine, backend):
    """LANE-4, OPS-4: an in-place reload is a writer: it waits for the running request, requests
    arriving meanwhile (before and during the load) queue behind it instead of being refused as
    draining, and they all run on the new load."""
    await engine.serve(["a"], X)
    backend.gated = True
    running = await engine.submit(request("running", binding="a", spec_=X, max_tokens=3))
    stream = await started(running)
    reload = asyncio.create_task(engine.reload(["a"], X))
    await until(lambda: lane_of(engine)["writers"] == 1, what="the reload to wait as a writer")
    arrival = await engine.submit(request("arrival", binding="a", spec_=X, max_tokens=2))
    assert (lane_of(engine)["queued"], lane_of(engine)["draining"]) == (1, False)
    assert engine.snapshot()[0]["reloading"]  # /readyz keeps the host in its balancer meanwhile
    ungate(backend)
    events = [event async for event in stream]
    assert events[-1].finish_reason == "length"  # finished, not aborted
    await asyncio.wait_for(reload, 5)
    assert not engine.snapshot()[0]["reloading"]
    assert backend.loads == [1, 1]
    assert (await collect(arrival))[-1].finish_reason == "length"


async def test_an_in_place_reload_aborts_what_outlives_the_drain_timeout(make_engine, backend):
    """LANE-7, OPS-4: a running stream that outlives the drain timeout is aborted (its Done says
    so); the request waiting behind the reload is still served, after it."""
    engine = make_engine(drain_timeout_s=0.05)
    await engine.serve(["a"], X)
    backend.gated = True
    running = await engine.submit(request("long", binding="a", spec_=X, max_tokens=100_000))
    stream = await started(running)
    waiting = await engine.submit(request("waiting", binding="a", spec_=X, max_tokens=2))
    reload = asyncio.create_task(engine.reload(["a"], X))
    await until(lambda: running.stop_flag.is_set(), what="the drain timeout to abort the stream")
    ungate(backend)
    events = [event async for event in stream]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "aborted"
    await asyncio.wait_for(reload, 5)
    assert (await collect(waiting))[-1].finish_reason == "length"
    assert backend.loads == [1, 1]
