"""Admission through the engine (LANE-*): budget, queue events, cancel, writers, drain, timeouts, probes."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine import (
    Delta,
    Done,
    DrainingError,
    DuplicateRequestError,
    Failed,
    Generation,
    LaneSettings,
    ModelSpec,
    Queued,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
    Started,
)
from tests.engine.conftest import collect, lane_idle, lane_of, next_event, request, spec, until


def laned(**settings) -> ModelSpec:
    """Instance 1 with the given lane settings."""
    return spec(1, lane=LaneSettings(**settings))


async def started(generation: Generation):
    """Open the stream and read up to `Started`; returns the open stream."""
    stream = generation.stream()
    while not isinstance(event := await next_event(stream), Started):
        assert isinstance(event, Queued), event
    return stream


def ungate(backend) -> None:
    backend.gated = False
    backend.gate.set()


async def test_burst_admits_capacity_plus_depth_and_rejects_the_rest_before_templating(engine, backend):
    """LANE-2: capacity 1 + depth 4, burst of 20: 5 admitted, 15 QueueFullError, 5 templated."""
    x = laned(capacity=1, queue_depth=4)
    await engine.load(x)
    backend.gated = True
    results = await asyncio.gather(
        *(engine.submit(request(f"r{i}", spec_=x, max_tokens=2)) for i in range(20)),
        return_exceptions=True,
    )
    admitted = [r for r in results if isinstance(r, Generation)]
    rejected = [r for r in results if isinstance(r, QueueFullError)]
    assert len(admitted) == 5
    assert len(rejected) == 15
    assert all(error.retry_after >= 1 for error in rejected)
    assert backend.render_calls == 5  # rejected requests never reached the chat template
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["permits"]) == (1, 4, 0)
    assert lane["saturated"] is True

    ungate(backend)
    streams = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in admitted)), 5)
    assert [type(events[-1]) for events in streams] == [Done] * 5
    assert [events[-1].finish_reason for events in streams] == ["length"] * 5
    assert len(backend.history) == 5


async def test_queued_requests_see_their_position_then_move_up(engine, backend):
    """API-3 / LANE-1: queued waiters get Queued(position), 1 = next in; positions shrink as the head runs."""
    await engine.load(spec(1))
    backend.gated = True
    first = await engine.submit(request("r1", max_tokens=1))
    second = await engine.submit(request("r2", max_tokens=1))
    third = await engine.submit(request("r3", max_tokens=1))
    ungate(backend)
    events = await asyncio.wait_for(asyncio.gather(collect(first), collect(second), collect(third)), 5)
    queued = [[e.position for e in stream if isinstance(e, Queued)] for stream in events]
    assert queued == [[], [1], [2, 1]]
    for stream in events:
        assert isinstance(stream[-1], Done)
        # Queue positions come before the request starts.
        started_at = next(i for i, e in enumerate(stream) if isinstance(e, Started))
        assert all(not isinstance(e, Queued) for e in stream[started_at:])


async def test_cancel_queued_ends_it_with_cancelled_and_admits_the_next(engine, backend):
    """LANE-6: engine.cancel on a queued request: Done(cancelled), slot freed, the next one runs."""
    await engine.load(spec(1))
    backend.gated = True
    running = await engine.submit(request("r1", max_tokens=1))
    victim = await engine.submit(request("r2", max_tokens=1))
    waiter = await engine.submit(request("r3", max_tokens=1))
    assert engine.cancel("r2") is True
    victim_events = await asyncio.wait_for(collect(victim), 2)
    assert victim_events == [Queued(position=1), victim_events[-1]]
    assert isinstance(victim_events[-1], Done)
    assert victim_events[-1].finish_reason == "cancelled"
    await victim.admitted()  # a cancelled request's admitted() returns; the stream tells the rest
    assert lane_of(engine)["queued"] == 1

    ungate(backend)
    first, last = await asyncio.wait_for(asyncio.gather(collect(running), collect(waiter)), 5)
    assert first[-1].finish_reason == last[-1].finish_reason == "length"
    assert [e.position for e in last if isinstance(e, Queued)] == [2, 1]
    assert len(backend.history) == 2  # the cancelled one never reached the model


async def test_cancel_before_arrival_aborts_on_arrival(engine, backend):
    """LANE-6: a cancel for an unseen id returns False and makes its later submit raise, untemplated."""
    await engine.load(spec(1))
    assert engine.cancel("x") is False
    with pytest.raises(RequestCancelledError):
        await engine.submit(request("x"))
    assert backend.render_calls == 0
    assert lane_of(engine)["permits"] == 0
    # The early cancel is used up: the id can be submitted again.
    events = await collect(await engine.submit(request("x", max_tokens=1)))
    assert events[-1].finish_reason == "length"


async def test_duplicate_id_is_refused_while_running_and_accepted_after(engine, backend):
    """LANE-5: a live id is refused with DuplicateRequestError; once it completed, it is accepted again."""
    await engine.load(spec(1))
    backend.gated = True
    first = await engine.submit(request("dup", max_tokens=1))
    stream = await started(first)
    with pytest.raises(DuplicateRequestError):
        await engine.submit(request("dup", max_tokens=1))
    assert backend.render_calls == 1
    ungate(backend)
    events = [event async for event in stream]
    assert events[-1].finish_reason == "length"
    await lane_idle(engine)  # Done is posted just before the slot is freed
    again = await collect(await engine.submit(request("dup", max_tokens=1)))
    assert again[-1].finish_reason == "length"


async def test_cancel_running_stops_within_one_token_and_frees_the_slot(engine, backend):
    """LANE-6: engine.cancel on a running request stops the worker within one token; active back to 0."""
    await engine.load(spec(1))
    backend.gated = True
    generation = await engine.submit(request("r1", max_tokens=10_000))
    stream = await started(generation)
    backend.gate.set()
    assert isinstance(await next_event(stream), Delta)
    produced = backend.tokens_generated
    assert engine.cancel("r1") is True
    backend.gate.set()  # at most one more step
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "cancelled"
    assert backend.tokens_generated <= produced + 1
    await lane_idle(engine)
    assert lane_of(engine)["active"] == 0
    assert engine.get(1).stats.requests_cancelled == 1


async def test_writer_waits_for_the_running_reader_and_blocks_later_ones(engine, backend):
    """LANE-4: unload waits for the running request; a reader arriving after it runs after, on a reload."""
    await engine.load(spec(1))
    assert backend.loads == [1]
    backend.gated = True
    running = await engine.submit(request("r1", max_tokens=1))
    stream = await started(running)
    unload = asyncio.create_task(engine.unload(1))
    await until(lambda: lane_of(engine)["writers"] == 1, what="the writer to queue")
    # r2 passes its pre-work while the model is still resident, then waits behind the writer.
    later = await engine.submit(request("r2", max_tokens=1))
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["writers"]) == (1, 1, 1)
    assert not unload.done()  # the writer waits for the running reader

    ungate(backend)
    assert [e async for e in stream][-1].finish_reason == "length"
    await asyncio.wait_for(unload, 2)
    events = await asyncio.wait_for(collect(later), 5)
    assert [e.position for e in events if isinstance(e, Queued)] == [1]
    assert isinstance(events[-1], Done), events[-1]  # not Failed(model_not_loaded)
    assert events[-1].finish_reason == "length"
    assert backend.loads == [1, 1]  # the reader after the unload loaded the model again
    assert engine.get(1).state == "ready"
    assert len(backend.history) == 2


async def test_a_failed_reload_behind_a_writer_is_reported(engine, backend):
    """LANE-4 / OPS-4: if the reload after an unload fails, the waiting reader gets Failed with the reason."""
    await engine.load(spec(1))
    backend.gated = True
    running = await engine.submit(request("r1", max_tokens=1))
    stream = await started(running)
    unload = asyncio.create_task(engine.unload(1))
    await until(lambda: lane_of(engine)["writers"] == 1, what="the writer to queue")
    later = await engine.submit(request("r2", max_tokens=1))
    backend.load_failures = 1
    ungate(backend)
    assert [e async for e in stream][-1].finish_reason == "length"
    await asyncio.wait_for(unload, 2)
    events = await asyncio.wait_for(collect(later), 5)
    assert isinstance(events[-1], Failed)
    assert events[-1].code == "model_load_failed"
    assert "fake load failure" in events[-1].message
    await lane_idle(engine)
    assert engine.get(1).state == "error"
    assert backend.loads == [1]
    # The next request loads it again through the normal path.
    events = await collect(await engine.submit(request("r3", max_tokens=1)))
    assert events[-1].finish_reason == "length"
    assert backend.loads == [1, 1]


async def test_drain_wait_refuses_fails_waiters_lets_the_running_finish_then_frees(engine, backend):
    """LANE-7: drain("wait"): waiters get DrainingError, new arrivals too, the running one finishes, then unload."""
    await engine.load(spec(1))
    backend.gated = True
    running = await engine.submit(request("r1", max_tokens=2))
    stream = await started(running)
    waiters = [await engine.submit(request(f"w{i}", max_tokens=2)) for i in range(2)]
    drain = asyncio.create_task(engine.drain(1, "wait"))
    for waiter in waiters:
        with pytest.raises(DrainingError):
            await asyncio.wait_for(waiter.admitted(), 2)
        events = await asyncio.wait_for(collect(waiter), 2)
        assert isinstance(events[-1], Failed)
        assert events[-1].code == "draining"
        assert events[-1].retry_after is not None and events[-1].retry_after >= 1
    renders = backend.render_calls
    with pytest.raises(DrainingError):
        await engine.submit(request("late"))
    assert backend.render_calls == renders  # refused at once, before templating
    assert not drain.done()

    ungate(backend)
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 2
    await asyncio.wait_for(drain, 5)
    instance = engine.get(1)
    assert instance.state == "unloaded"
    assert instance.model is None
    assert len(backend.history) == 1
    # Drained for unload, not for good: the next request loads the model again.
    events = await collect(await engine.submit(request("after", max_tokens=1)))
    assert events[-1].finish_reason == "length"
    assert backend.loads == [1, 1]


async def test_drain_abort_cancels_the_running_request(engine, backend):
    """LANE-7: drain("abort") aborts the running request: it ends with Done(aborted), never a
    client's "cancelled" or a complete "stop", then unloads."""
    await engine.load(spec(1))
    backend.gated = True
    running = await engine.submit(request("r1", max_tokens=10_000))
    stream = await started(running)
    drain = asyncio.create_task(engine.drain(1, "abort"))
    await until(lambda: running.stop_flag.is_set(), what="the abort to reach the request")
    backend.gate.set()  # the worker sees the flag after at most one more token
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason == "aborted"
    assert events[-1].usage.completion_tokens <= 1
    await asyncio.wait_for(drain, 5)
    assert engine.get(1).state == "unloaded"


async def test_queue_timeout_fails_the_waiter_only(engine, backend):
    """LANE-8: a waiter past queue_timeout_s gets QueueTimeoutError (and Failed); the running one is unaffected."""
    x = laned(queue_timeout_s=0.05)
    await engine.load(x)
    backend.gated = True
    running = await engine.submit(request("r1", spec_=x, max_tokens=2))
    stream = await started(running)
    waiter = await engine.submit(request("r2", spec_=x, max_tokens=2))
    with pytest.raises(QueueTimeoutError) as info:
        await asyncio.wait_for(waiter.admitted(), 2)
    assert info.value.retry_after >= 1
    events = await asyncio.wait_for(collect(waiter), 2)
    assert events[0] == Queued(position=1)
    assert isinstance(events[-1], Failed)
    assert events[-1].code == "queue_timeout"
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"]) == (1, 0)

    ungate(backend)
    events = [event async for event in stream]
    assert isinstance(events[-1], Done)
    assert events[-1].usage.completion_tokens == 2
    assert len(backend.history) == 1


async def test_probe_counters_in_the_snapshot(engine, backend, monkeypatch):
    """LANE-9: snapshot()[i]["lane"] reports active, queued, permits, capacity, limit and saturated."""
    x = laned(capacity=1, queue_depth=2)
    engine.bind("a", x)
    assert lane_of(engine) == {
        "active": 0,
        "queued": 0,
        "permits": 0,
        "writers": 0,
        "capacity": 1,
        "limit": 3,
        "saturated": False,
        "draining": False,
    }
    # A request waiting for the model to load holds a pre-dispatch permit (LANE-3).
    loading = asyncio.Event()
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_load = backend.load

    def slow_load(spec_, progress):
        loop.call_soon_threadsafe(loading.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
        return real_load(spec_, progress)

    monkeypatch.setattr(backend, "load", slow_load)
    backend.gated = True
    first = asyncio.create_task(engine.submit(request("r1", binding="a", spec_=x, max_tokens=1)))
    await asyncio.wait_for(loading.wait(), 2)
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["permits"], lane["writers"]) == (0, 0, 1, 1)
    release.set()
    running = await asyncio.wait_for(first, 2)
    stream = await started(running)

    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["permits"], lane["saturated"]) == (1, 0, 0, False)
    second = await engine.submit(request("r2", binding="a", spec_=x, max_tokens=1))
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["saturated"]) == (1, 1, False)
    third = await engine.submit(request("r3", binding="a", spec_=x, max_tokens=1))
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["permits"]) == (1, 2, 0)
    assert (lane["capacity"], lane["limit"], lane["saturated"]) == (1, 3, True)
    with pytest.raises(QueueFullError):
        await engine.submit(request("r4", binding="a", spec_=x))

    ungate(backend)
    await asyncio.wait_for(asyncio.gather(*(collect(g) for g in (second, third))), 5)
    assert [e async for e in stream][-1].finish_reason == "length"
    await lane_idle(engine)
    assert lane_of(engine)["saturated"] is False


async def test_a_stalled_worker_is_reported(make_engine, backend):
    """OPS-2: a worker that holds a request without producing a token past stall_after_s shows stalled."""
    engine = make_engine(stall_after_s=0.05)
    await engine.load(spec(1))
    assert engine.snapshot()[0]["stalled"] is False  # idle is not stalled
    backend.gated = True
    generation = await engine.submit(request("r1", max_tokens=1))
    stream = await started(generation)
    await until(lambda: engine.snapshot()[0]["stalled"] is True, what="the stall to be reported")
    assert engine.snapshot()[0]["stalled_s"] >= 0.05
    ungate(backend)
    assert [e async for e in stream][-1].finish_reason == "length"
    await lane_idle(engine)
    assert engine.snapshot()[0]["stalled"] is False
