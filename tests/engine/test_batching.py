"""The batched scheduler with the fake backend (LANE-1, LANE-6, SES-1, SES-5): interleaving, cancels, caches."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxhost.engine import Delta, Done, Failed, LaneSettings, Message, ModelSpec, Started
from mlxhost.engine.backends.fake import GENERATED_ID_BASE, FakeBatch
from tests.engine.conftest import collect, lane_idle, lane_of, next_event, request, spec, until


def batching(capacity: int) -> ModelSpec:
    """Instance 1 served by a lane of `capacity`: the batched scheduler."""
    return spec(1, lane=LaneSettings(capacity=capacity))


def ungate(backend) -> None:
    backend.gated = False
    backend.gate.set()


def token_ids(events) -> list[int]:
    return [token for event in events if isinstance(event, Delta) for token in event.token_ids]


def text_of(events) -> str:
    return "".join(event.text for event in events if isinstance(event, Delta))


async def started(generation):
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    return stream


async def submit_all(engine, x: ModelSpec, specs: list[dict]) -> list:
    """Submit in order (the fake hands out scripts in insert order); returns the generations."""
    return [await engine.submit(request(f"r{i}", spec_=x, **kwargs)) for i, kwargs in enumerate(specs)]


async def first_then_rest(engine, backend, x: ModelSpec, specs: list[dict]):
    """Gated: r0 alone in the batch with the worker parked on step 1's gate, then the rest queued.

    Returns r0's open stream and every generation; the rest join the batch right after step 1.
    """
    first = await engine.submit(request("r0", spec_=x, **specs[0]))
    stream = await started(first)
    await until(lambda: backend.parked, what="the worker to park on the gate")
    rest = [await engine.submit(request(f"r{i}", spec_=x, **kw)) for i, kw in enumerate(specs[1:], 1)]
    return stream, [first, *rest]


async def collect_rest(stream) -> list:
    return [event async for event in stream]


async def test_requests_share_decode_steps_each_with_its_own_script_and_limit(engine, backend):
    """LANE-1: capacity 4 batches 4 requests; one step gives each one token; scripts and max_tokens are per request."""
    x = batching(4)
    await engine.load(x)
    backend.gated = True
    scripts = [["a1", "a2", "a3"], ["b1", "b2", "b3", "b4", "b5"], ["c1"], ["d1", "d2", "d3", "d4"]]
    for script in scripts:
        backend.enqueue(script)
    specs = [{"max_tokens": 10}, {"max_tokens": 3}, {"max_tokens": 10}, {}]
    first, generations = await first_then_rest(engine, backend, x, specs)
    backend.gate.set()  # step 1: only r0 was inserted before the worker parked on the gate
    assert (await next_event(first)).text == "a1"
    streams = [first] + [await started(g) for g in generations[1:]]  # inserted right after step 1
    backend.gate.set()  # step 2: all four advance together
    assert [(await next_event(s)).text for s in streams] == ["a2", "b1", "c1", "d1"]
    assert backend.batch_steps == [1, 4]

    ungate(backend)
    rest = await asyncio.wait_for(asyncio.gather(*(collect_rest(s) for s in streams)), 5)
    assert [text_of(events) for events in rest] == ["a3", "b2b3", "", "d2d3d4"]
    dones = [events[-1] for events in rest]
    assert [d.finish_reason for d in dones] == ["stop", "length", "stop", "stop"]
    assert [d.usage.completion_tokens for d in dones] == [3, 3, 1, 4]
    assert backend.tokens_generated == 11
    assert max(backend.batch_steps) == 4
    await lane_idle(engine)
    stats = engine.get(1).stats
    # The lane frees on the loop; the worker thread clears its own counters a moment later.
    await until(lambda: stats.batch_size == 0 and stats.active_request is None, what="the worker to go idle")
    assert (stats.batch_size, stats.active_request, stats.requests_finished) == (0, None, 4)


async def test_a_cancel_mid_batch_leaves_the_others_intact_with_exact_counts(engine, backend):
    """LANE-6: cancelling one batched request ends it within one step; the others finish exactly."""
    x = batching(3)
    await engine.load(x)
    backend.gated = True
    first, generations = await first_then_rest(engine, backend, x, [{"max_tokens": 6}] * 3)
    backend.gate.set()
    first_events = [await next_event(first)]
    streams = [first] + [await started(g) for g in generations[1:]]
    backend.gate.set()
    seen = [[await next_event(s)] for s in streams]
    seen[0] = first_events + seen[0]
    # The worker is parked inside step 3, past its cancel check: r1 gets that one more token.
    await until(lambda: backend.parked, what="the worker to park on step 3")
    assert engine.cancel("r1") is True
    ungate(backend)
    rest = await asyncio.wait_for(asyncio.gather(*(collect_rest(s) for s in streams)), 5)
    events = [before + after for before, after in zip(seen, rest, strict=True)]

    cancelled = events[1][-1]
    assert isinstance(cancelled, Done)
    assert cancelled.finish_reason == "cancelled"
    # Removed before step 4: exactly one more step than when the cancel came (LANE-6).
    assert cancelled.usage.completion_tokens == len(token_ids(events[1])) == 2
    for survivor in (events[0], events[2]):
        assert survivor[-1].finish_reason == "length"
        assert survivor[-1].usage.completion_tokens == 6
        assert text_of(survivor) == "tok " * 6
        assert token_ids(survivor) == [GENERATED_ID_BASE + i for i in range(6)]
    assert backend.tokens_generated == 14
    assert backend.batch_steps == [1, 3, 3, 2, 2, 2, 1]
    await lane_idle(engine)
    assert lane_of(engine)["active"] == 0
    assert engine.get(1).stats.requests_cancelled == 1


async def test_finished_sequences_hand_back_exact_caches_and_many_are_kept(engine, backend):
    """SES-1 / SES-5: each batched turn is adopted with its exact tokens, one cut by its length
    too; a batching instance keeps many."""
    x = batching(4)
    await engine.load(x)
    backend.gated = True
    queries = [engine.scoper.query(tenant=f"t{i}") for i in range(4)]
    backend.enqueue(["Hello"])  # ends with "stop": the script is done before max_tokens
    backend.enqueue(["x", "END", "y"])  # a text stop string ends it: removed from the batch mid-flight
    backend.enqueue(["z"] * 5)  # max_tokens: truncated, kept with the tokens its cache holds
    backend.enqueue(["a", "b"])
    sampling = [{"max_tokens": 9}, {"max_tokens": 9, "stop": ("END",)}, {"max_tokens": 2}, {"max_tokens": 9}]
    generations = [
        await engine.submit(request(f"r{i}", text=f"turn {i}", session=q, spec_=x, **kw))
        for i, (q, kw) in enumerate(zip(queries, sampling, strict=True))
    ]
    ungate(backend)
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)
    assert [events[-1].finish_reason for events in results] == ["stop", "stop", "length", "stop"]
    await lane_idle(engine)

    instance = engine.get(1)
    assert instance.sessions.stats.entries == 4
    entries = instance.sessions._entries  # the exact tokens each cache holds
    for rid, produced in (("r0", 1), ("r1", 2), ("r2", 2), ("r3", 2)):
        prompt = [ord(ch) for ch in f"<user>turn {rid[1]}<assistant>"]
        # Every returned token is already in the cache (the "END" token too), the stop marker is not.
        assert entries[rid].tokens == (*prompt, *(GENERATED_ID_BASE + i for i in range(produced)))
        assert len(entries[rid].kv.tokens) == len(entries[rid].tokens)
    assert backend.dispose_calls == 0

    # All three continue at once, each on its own warm cache.
    follow_ups = [
        await engine.submit(
            request(
                f"c{rid}",
                messages=(
                    Message("user", f"turn {rid[1]}"),
                    Message("assistant", "x"),
                    Message("user", "more"),
                ),
                session=engine.scoper.query(tenant=f"t{rid[1]}", previous_response_id=rid),
                spec_=x,
                max_tokens=1,
            )
        )
        for rid in ("r0", "r1", "r3")
    ]
    assert [g.session_outcome for g in follow_ups] == ["hit"] * 3
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in follow_ups)), 5)
    assert [events[0].cached_tokens for events in results] == [len("<user>turn 0<assistant>")] * 3


async def test_a_batch_cache_whose_length_disagrees_with_its_tokens_is_never_adopted(
    engine, backend, monkeypatch, caplog
):
    """SES-1 (issue 25): on the batched adopt path the cache must hold exactly `len(tokens)`
    tokens; one that holds another number is disposed and logged, never kept as a warm session
    (a later turn would start from the wrong state). An exact one is kept."""
    x = batching(2)
    await engine.load(x)
    removed = FakeBatch.remove

    def off_by_one(self, handle):
        cache = removed(self, handle)
        return type(cache)(cache.kv, cache.tokens[:-1])

    monkeypatch.setattr(FakeBatch, "remove", off_by_one)
    query = engine.scoper.query(tenant="t")
    events = await collect(await engine.submit(request("r0", session=query, spec_=x, max_tokens=2)))
    assert isinstance(events[-1], Done)
    await lane_idle(engine)
    instance = engine.get(1)
    assert instance.sessions.stats.entries == 0 and backend.dispose_calls == 1
    assert "not kept as a warm session" in caplog.text

    monkeypatch.setattr(FakeBatch, "remove", removed)
    await collect(await engine.submit(request("r1", session=query, spec_=x, max_tokens=2)))
    await lane_idle(engine)
    assert instance.sessions.stats.entries == 1 and backend.dispose_calls == 1


async def test_a_seed_request_joins_the_running_batch(engine, backend):
    """LANE-1 (issue 12): a seeded request shares the batch like any other: it joins between steps."""
    x = batching(2)
    await engine.load(x)
    backend.gated = True
    a, generations = await first_then_rest(
        engine, backend, x, [{"max_tokens": 3}, {"max_tokens": 2, "seed": 7}]
    )
    ungate(backend)
    results = await asyncio.wait_for(asyncio.gather(collect_rest(a), collect(generations[1])), 5)
    assert [events[-1].usage.completion_tokens for events in results] == [3, 2]
    assert [h[2].seed for h in backend.history] == [None, 7]
    assert len(backend.batches) == 1 and 2 in backend.batch_steps  # they shared steps


async def test_a_request_the_batch_refuses_runs_alone_in_fifo_order_without_starving(engine, backend):
    """LANE-1: a request the batch cannot take (here: seeds, on a backend that refuses them) waits
    for the batch to drain, runs alone, then batching resumes."""
    backend.exclusive_seeds = True
    x = batching(3)
    await engine.load(x)
    backend.gated = True
    specs = [{"max_tokens": 2}, {"max_tokens": 2, "seed": 7}, {"max_tokens": 2}]
    a, generations = await first_then_rest(engine, backend, x, specs)
    backend.gate.set()
    assert isinstance(await next_event(a), Delta)
    # Parked on step 2's gate, the worker has already chosen that step's batch.
    await until(lambda: backend.parked, what="the worker to park on step 2's gate")
    # The seeded one waits at the head of the worker's FIFO; the later one waits behind it.
    assert [h[2].seed for h in backend.history] == [None]
    assert backend.batch_steps == [1]

    ungate(backend)
    results = await asyncio.wait_for(
        asyncio.gather(collect_rest(a), *(collect(g) for g in generations[1:])), 5
    )
    assert [events[-1].usage.completion_tokens for events in results] == [2, 2, 2]
    assert [events[-1].finish_reason for events in results] == ["length"] * 3
    assert [h[2].seed for h in backend.history] == [None, 7, None]  # FIFO: nobody overtook the seeded one
    assert backend.batch_steps == [1, 1, 1, 1]  # the seeded one ran on the exclusive path
    assert len(backend.batches) == 1  # batching resumed on the same batch


async def test_a_cancelled_waiter_behind_an_exclusive_turn_frees_its_slot_at_once(engine, backend):
    """LANE-6: a request queued on the worker behind an exclusive one is cancelled without waiting for the batch."""
    backend.exclusive_seeds = True
    x = batching(3)
    await engine.load(x)
    backend.gated = True
    specs = [{"max_tokens": 50}, {"max_tokens": 2, "seed": 1}, {"max_tokens": 2}]
    running, generations = await first_then_rest(engine, backend, x, specs)
    assert engine.cancel("r2") is True
    backend.gate.set()  # one step; r0 still has 49 to go when r2 is ended
    events = await asyncio.wait_for(collect(generations[2]), 2)
    assert events[-1].finish_reason == "cancelled"
    await until(lambda: lane_of(engine)["active"] == 2, what="the cancelled slot to be freed")
    assert [h[2].seed for h in backend.history] == [None]  # it never reached the model
    ungate(backend)
    assert [e async for e in running][-1].finish_reason == "length"
    assert (await asyncio.wait_for(collect(generations[1]), 5))[-1].finish_reason == "length"


@pytest.mark.parametrize("reason", ["no batching", "shared cache"])
async def test_a_model_that_cannot_batch_serves_one_at_a_time(engine, backend, reason):
    """SES-5 / LANE-1: a model without a batch (or with one shared cache) runs every request exclusively."""
    if reason == "no batching":
        backend.batching = False
    else:
        backend.shared_cache = True
    x = batching(2)
    await engine.load(x)
    generations = await submit_all(engine, x, [{"max_tokens": 3}] * 2)
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)
    assert [events[-1].usage.completion_tokens for events in results] == [3, 3]
    assert backend.batch_steps == []
    assert backend.batches == []


async def test_a_failing_batch_step_fails_its_requests_and_a_new_batch_serves_the_next(
    engine, backend, monkeypatch
):
    """OPS-2: a backend error mid-batch ends every batched request with Failed; the lane is freed."""
    x = batching(2)
    await engine.load(x)
    real_step = FakeBatch.step
    broken = {"left": 1}

    def step(self):
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("boom")
        return real_step(self)

    monkeypatch.setattr(FakeBatch, "step", step)
    events = await asyncio.wait_for(collect(await engine.submit(request("r1", spec_=x, max_tokens=2))), 5)
    assert isinstance(events[-1], Failed)
    assert events[-1].code == "generation_failed"
    await lane_idle(engine)
    assert engine.get(1).stats.requests_failed == 1
    assert backend.batches[0].closed

    events = await asyncio.wait_for(collect(await engine.submit(request("r2", spec_=x, max_tokens=2))), 5)
    assert events[-1].finish_reason == "length"
    assert len(backend.batches) == 2


async def test_lowering_capacity_to_one_switches_to_the_exclusive_scheduler(engine, backend):
    """LANE-1: the lane's capacity is the batch's; capacity 1 serves through `model.generate` again."""
    await engine.load(batching(2))
    await collect(await engine.submit(request("r1", spec_=batching(2), max_tokens=2)))
    assert backend.batch_steps == [1, 1]
    await lane_idle(engine)
    engine.bind("instance:1", batching(1))  # control applies the new capacity (REG-5)
    await collect(await engine.submit(request("r2", spec_=batching(1), max_tokens=2)))
    assert backend.batch_steps == [1, 1]
    assert len(backend.history) == 2


@pytest.mark.parametrize("capacity", [pytest.param(1, id="exclusive"), pytest.param(2, id="batched")])
async def test_token_ids_add_up_to_completion_tokens_while_a_stop_string_holds_text(
    engine, backend, capacity
):
    """Both schedulers: every counted token reaches the reader, even while its text is withheld;
    Done names the stop string that ended the turn."""
    backend.enqueue(["The ", "ans", "wer. ", "EN", "D here", " more"])
    events = await collect(
        await engine.submit(request(spec_=batching(capacity), max_tokens=50, stop=("END",)))
    )
    assert text_of(events) == "The answer. "
    assert (events[-1].finish_reason, events[-1].stop_sequence) == ("stop", "END")
    assert token_ids(events) == [GENERATED_ID_BASE + i for i in range(5)]
    assert events[-1].usage.completion_tokens == 5
    assert len(backend.batch_steps) == (0 if capacity == 1 else 5)


def hold_slow_renders(backend) -> threading.Event:
    """Requests whose text contains "slow" stay in templating (holding a lane permit) until set."""
    release = threading.Event()

    def before_render(messages) -> None:
        if any("slow" in message.content for message in messages):
            release.wait(timeout=30)

    backend.before_render = before_render
    return release


async def test_a_burst_still_templating_is_prefilled_together_with_its_first_request(make_engine, backend):
    """LANE-1: a batch about to start waits for the burst's other requests still preparing.

    r0 reaches the worker while r1 is still being templated (it holds a permit); the worker
    gathers instead of starting r0 alone, so both are inserted before the first batch step.
    """
    engine = make_engine(burst_wait_s=30.0)  # bounded only by r1's arrival here
    release = hold_slow_renders(backend)
    x = batching(4)
    fast = asyncio.create_task(engine.submit(request("r0", spec_=x, text="fast", max_tokens=3)))
    slow = asyncio.create_task(engine.submit(request("r1", spec_=x, text="slow", max_tokens=3)))
    await until(
        lambda: any(i.stats.gathering for i in engine.registry.instances()),
        what="the worker to gather the burst",
    )
    assert backend.batch_steps == []  # r0 waits; nothing was prefilled alone
    release.set()
    events = [await collect(await fast), await collect(await slow)]
    assert backend.batch_steps[0] == 2  # both in the first step
    assert [token_ids(e) for e in events] == [token_ids(events[0])] * 2
    assert all(isinstance(e[-1], Done) and e[-1].usage.completion_tokens == 3 for e in events)
    assert engine.get(1).stats.burst_waits == 1


async def test_the_burst_wait_is_bounded_and_a_lone_request_never_waits(make_engine, backend):
    """LANE-1: past `burst_wait_s` the first request starts alone; with no other permit, no wait."""
    engine = make_engine(burst_wait_s=0.05)
    release = hold_slow_renders(backend)
    x = batching(4)
    lone = await collect(await engine.submit(request("r-lone", spec_=x, text="fast", max_tokens=2)))
    assert isinstance(lone[-1], Done)
    assert engine.get(1).stats.burst_waits == 0  # nobody else was preparing

    held = asyncio.create_task(engine.submit(request("r1", spec_=x, text="slow", max_tokens=2)))
    await until(lambda: backend.render_calls == 2, what="r1 to hold its permit, templating")
    assert lane_of(engine)["permits"] == 1
    first = await collect(await engine.submit(request("r0", spec_=x, text="fast", max_tokens=2)))
    assert isinstance(first[-1], Done) and first[-1].usage.completion_tokens == 2  # while r1 is held
    assert engine.get(1).stats.burst_waits == 1
    release.set()
    second = await collect(await held)
    assert isinstance(second[-1], Done) and second[-1].usage.completion_tokens == 2
    assert backend.batch_steps.count(2) == 0  # r0 and r1 never shared a step


async def test_the_burst_wait_ends_on_the_engines_clock(make_engine, backend, fake_clock):
    """LANE-1: `burst_wait_s` is read on the clock the engine was given, not the wall clock.

    The wait would last 30 s on the wall clock; advancing the engine's clock past it ends it, and
    r0 starts alone while r1 is still templating.
    """
    engine = make_engine(clock=fake_clock, burst_wait_s=30.0)
    release = hold_slow_renders(backend)
    x = batching(4)
    held = asyncio.create_task(engine.submit(request("r1", spec_=x, text="slow", max_tokens=2)))
    await until(lambda: backend.render_calls == 1, what="r1 to hold its permit, templating")
    first = asyncio.create_task(engine.submit(request("r0", spec_=x, text="fast", max_tokens=2)))
    await until(lambda: engine.get(1).stats.gathering, what="the worker to gather the burst")
    assert backend.batch_steps == []
    fake_clock.advance(31.0)
    events = await asyncio.wait_for(collect(await first), 3.0)
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 2  # while r1 is held
    assert engine.get(1).stats.burst_waits == 1 and not held.done()
    release.set()
    second = await collect(await held)
    assert isinstance(second[-1], Done) and backend.batch_steps.count(2) == 0


@pytest.mark.parametrize(("can_batch", "served"), [(True, (3, 0, 4)), (False, (1, 2, 1))])
async def test_a_model_that_cannot_batch_is_served_one_at_a_time(engine, backend, can_batch, served):
    """LANE-1 (issue 25): a lane capacity above 1 on a model that cannot batch is clamped to 1, so
    the requests it cannot run wait in the lane, where `active`, `queued`, queue positions and the
    queue timeout see them, not hidden inside the worker; the snapshot says what was asked for."""
    backend.batching = can_batch
    x = batching(4)
    await engine.load(x)
    backend.gated = True
    generations = await submit_all(engine, x, [{"max_tokens": 2}] * 3)
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["capacity"]) == served
    (snap,) = engine.snapshot()
    assert (snap["configured_capacity"], snap["can_batch"]) == (4, can_batch)
    ungate(backend)
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)
    assert all(isinstance(events[-1], Done) for events in results)
    await lane_idle(engine)
