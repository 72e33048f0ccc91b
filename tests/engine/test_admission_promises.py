"""Admission promises the review found broken: permits before pre-work, cancels never lost, honest aborts."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine import (
    Done,
    DrainingError,
    Failed,
    LaneSettings,
    QueueFullError,
    RequestCancelledError,
    Started,
)
from tests.engine.conftest import collect, lane_idle, lane_of, next_event, request, spec, until


def laned(**settings):
    return spec(1, lane=LaneSettings(**settings))


async def test_a_reserved_permit_counts_against_the_budget_and_is_handed_in_once(engine, backend):
    """LANE-3, LANE-2: a permit from `reserve` holds a place in the budget while its holder does
    async pre-work; `submit` hands it into the lane without counting it twice."""
    await engine.load(laned(capacity=1, queue_depth=1))
    permit = engine.reserve("held", "instance:1")
    assert lane_of(engine)["permits"] == 1
    running = await engine.submit(request("other", spec_=laned(capacity=1, queue_depth=1), max_tokens=1))
    with pytest.raises(QueueFullError):  # 1 permit + 1 running = capacity + depth
        engine.reserve("third", "instance:1")
    await collect(running)
    generation = await engine.submit(
        request("held", spec_=laned(capacity=1, queue_depth=1), max_tokens=1), permit
    )
    assert (await collect(generation))[-1].finish_reason == "length"
    permit.release()  # already handed in: a no-op
    await lane_idle(engine)
    assert lane_of(engine)["permits"] == 0


async def test_a_released_permit_frees_its_place_and_a_second_release_is_harmless(engine, backend):
    """LANE-3: bail-out releases the permit; releasing twice never frees someone else's place."""
    await engine.load(laned(capacity=1, queue_depth=0))
    permit = engine.reserve("bail", "instance:1")
    with pytest.raises(QueueFullError):
        engine.reserve("next", "instance:1")
    permit.release()
    second = engine.reserve("next", "instance:1")
    permit.release()
    with pytest.raises(QueueFullError):  # `second` still holds the only place
        engine.reserve("third", "instance:1")
    second.release()
    assert lane_of(engine)["permits"] == 0


async def test_a_pre_cancelled_request_on_a_full_lane_is_told_cancelled_not_queue_full(engine, backend):
    """LANE-6: a cancel that arrived before its request wins over a full lane (409, not 429)."""
    await engine.load(laned(capacity=1, queue_depth=0))
    backend.gated = True
    running = await engine.submit(request("runs", spec_=laned(capacity=1, queue_depth=0), max_tokens=10_000))
    stream = running.stream()
    assert isinstance(await next_event(stream), Started)
    assert engine.cancel("early") is False  # not here yet: remembered for its arrival
    with pytest.raises(RequestCancelledError):
        await engine.submit(request("early", spec_=laned(capacity=1, queue_depth=0)))
    running.cancel()
    backend.gated = False
    backend.gate.set()
    await stream.aclose()


async def test_cancelling_a_finished_id_leaves_no_tripwire_for_a_reused_id(engine, backend):
    """LANE-6: a cancel for an id that just finished is late, not early; a later request with the
    same id runs instead of being cancelled on arrival."""
    await engine.load(spec(1))
    assert (await collect(await engine.submit(request("reused", max_tokens=1))))[-1].finish_reason == "length"
    await lane_idle(engine)
    assert engine.cancel("reused") is False
    again = await collect(await engine.submit(request("reused", max_tokens=1)))
    assert again[-1].finish_reason == "length"


async def test_a_drain_timeout_aborts_the_stream_and_its_done_says_aborted(engine, backend):
    """LANE-7: a drain with a timeout refuses arrivals, then aborts what still runs; the stream's
    Done says "aborted" (neither a complete "stop" nor a client's "cancelled")."""
    await engine.load(spec(1))
    backend.gated = True
    running = await engine.submit(request("long", max_tokens=10_000))
    stream = running.stream()
    assert isinstance(await next_event(stream), Started)
    drain = asyncio.create_task(engine.drain(1, "wait", timeout=0.05))
    await until(lambda: lane_of(engine)["draining"], what="the drain to start")
    with pytest.raises(DrainingError):
        await engine.submit(request("late", max_tokens=1))
    await until(lambda: running.stop_flag.is_set(), what="the drain timeout to abort the stream")
    backend.gated = False
    backend.gate.set()
    events = [event async for event in stream]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "aborted"
    await asyncio.wait_for(drain, 5)


@pytest.mark.parametrize("batching", [True, False])
async def test_the_slot_is_free_before_the_answer_is_posted(engine, backend, batching):
    """API-3 / LANE-1: the terminal Done is posted only after the lane slot is released, so a
    client that sends its next request the moment it has its answer is admitted, never refused
    as queue_full on a full lane (capacity 1, no queue; the CI found this race)."""
    backend.batching = batching
    model = spec(1, lane=LaneSettings(capacity=1 if not batching else 2, queue_depth=0))
    await engine.load(model)
    generation = await engine.submit(request("a", spec_=model, max_tokens=2))
    active_at_done = []
    real_post = generation.post

    def post(event):
        if isinstance(event, Done):
            active_at_done.append(lane_of(engine)["active"])
        real_post(event)

    generation.post = post
    events = await asyncio.wait_for(collect(generation), 5)
    assert isinstance(events[-1], Done)
    assert active_at_done == [0]


async def test_a_failed_answer_is_also_posted_after_the_slot_is_released(engine, backend):
    """API-3 (issue 26): a worker's Failed waits for its job's end like a Done, so the turn's one
    end frees the slot (and counts it) before the client hears it."""
    backend.generate_failures = 1
    model = spec(1, lane=LaneSettings(capacity=1, queue_depth=0))
    await engine.load(model)
    generation = await engine.submit(request("a", spec_=model, max_tokens=2))
    active_at_end = []
    real_post = generation.post

    def post(event):
        if isinstance(event, Failed) and generation.terminal is None:
            active_at_end.append(lane_of(engine)["active"])
        real_post(event)

    generation.post = post
    events = await asyncio.wait_for(collect(generation), 5)
    assert isinstance(events[-1], Failed) and events[-1].code == "generation_failed"
    assert active_at_end[-1] == 0
