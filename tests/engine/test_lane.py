"""Lane admission: FIFO, budget, permits, cancel, writers, drain, queue timeout, probes."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
)
from mlxhost.engine.lane import Lane, Ticket, TicketHooks
from tests.support import FakeClock, eventually


def within_budget(lane: Lane) -> bool:
    probe = lane.probe()
    return probe.limit is None or probe.active + probe.queued + probe.permits <= probe.limit


def admit(lane: Lane, request_id: str, order: list[str] | None = None, **hooks) -> Ticket:
    """Reserve and enter in one go, recording admission order through on_admit."""
    ticket = lane.reserve(request_id)
    if order is not None:
        hooks["on_admit"] = lambda t: order.append(t.request_id)
    lane.enter(ticket, TicketHooks(**hooks))
    assert within_budget(lane)
    return ticket


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_burst_over_budget_rejects_exactly_the_excess():
    """LANE-2: capacity 1 + depth 4 admits 5 of a burst of 20; 15 get QueueFullError with retry_after."""
    lane = Lane(capacity=1, queue_depth=4)
    tickets, rejected = [], []
    for i in range(20):
        try:
            tickets.append(lane.reserve(f"r{i}"))
        except QueueFullError as error:
            rejected.append(error)
    assert len(tickets) == 5
    assert len(rejected) == 15
    assert all(error.retry_after >= 1 for error in rejected)
    assert lane.probe().permits == 5
    assert within_budget(lane)


async def test_retry_after_follows_how_long_tickets_stay_active():
    """LANE-2: Retry-After grows with the measured service time and the queue length, capped at 60."""
    clock = FakeClock()
    lane = Lane(capacity=1, queue_depth=2, clock=clock)
    for i in range(20):
        ticket = admit(lane, f"slow{i}")
        clock.advance(10.0)
        lane.release(ticket)
    admit(lane, "a")
    admit(lane, "b")
    admit(lane, "c")
    with pytest.raises(QueueFullError) as caught:
        lane.reserve("d")
    assert 20 <= caught.value.retry_after <= 60  # ewma ~10 s x (2 queued + 1)


@pytest.mark.parametrize("capacity", [pytest.param(1, id="mutex"), pytest.param(2, id="semaphore")])
async def test_waiters_are_admitted_in_arrival_order(capacity: int):
    """LANE-1: FIFO among waiters under interleaved arrivals and releases."""
    lane = Lane(capacity=capacity, queue_depth=16)
    order: list[str] = []
    running = [admit(lane, f"r{i}", order) for i in range(capacity)]
    waiting = [admit(lane, f"q{i}", order) for i in range(3)]
    assert [t.state for t in waiting] == ["queued"] * 3
    assert [t.position for t in waiting] == [1, 2, 3]
    arrivals = 0
    while running:
        lane.release(running.pop(0))
        # A fresh arrival right after a slot frees must queue behind the older waiters.
        if arrivals < 3:
            waiting.append(admit(lane, f"late{arrivals}", order))
            arrivals += 1
        running.extend(t for t in waiting if t.state == "active" and t not in running)
        assert lane.active <= capacity
        assert within_budget(lane)
    expected = [f"r{i}" for i in range(capacity)] + ["q0", "q1", "q2", "late0", "late1", "late2"]
    assert order == expected
    assert lane.probe().as_dict()["active"] == 0


async def test_admitted_future_resolves_after_on_admit():
    """LANE-1: a queued ticket's future resolves when it becomes active; positions advance."""
    lane = Lane(capacity=1)
    first = admit(lane, "a")
    second = lane.reserve("b")  # reserved before c but entered after it: entry order decides
    positions: list[int] = []
    seen_done: list[bool] = []
    third = admit(lane, "c", on_admit=lambda t: seen_done.append(t.admitted.done()))
    lane.enter(second, TicketHooks(on_position=positions.append))
    assert (third.position, second.position) == (1, 2)
    lane.release(first)
    await asyncio.wait_for(third.admitted, 1)
    assert seen_done == [False]
    assert second.position == 1
    assert positions == [2, 1]
    lane.release(third)
    await asyncio.wait_for(second.admitted, 1)
    assert second.state == "active"
    assert second.position == 0


async def test_permit_handoff_never_double_counts():
    """LANE-3: a permit turns into exactly one active or queued entry; releases are idempotent."""
    lane = Lane(capacity=1, queue_depth=2)
    first, second = lane.reserve("a"), lane.reserve("b")
    assert (lane.active, lane.queued, lane.permits) == (0, 0, 2)
    lane.enter(first)
    assert (lane.active, lane.queued, lane.permits) == (1, 0, 1)
    lane.enter(second)
    assert (lane.active, lane.queued, lane.permits) == (1, 1, 0)
    assert within_budget(lane)
    with pytest.raises(RuntimeError):
        lane.enter(second)
    third = lane.reserve("c")
    assert (lane.active, lane.queued, lane.permits) == (1, 1, 1)
    lane.release(third)
    lane.release(third)
    assert (lane.active, lane.queued, lane.permits) == (1, 1, 0)
    with pytest.raises(RuntimeError):
        lane.enter(third)
    lane.release(first)
    assert (lane.active, lane.queued, lane.permits) == (1, 0, 0)
    lane.release(first)  # after the handoff this is a no-op: second keeps its slot
    assert (lane.active, lane.queued, lane.permits) == (1, 0, 0)
    assert second.state == "active"
    assert within_budget(lane)


async def test_cancel_queued_frees_its_place_and_admits_the_next():
    """LANE-6: a cancelled waiter leaves the queue with RequestCancelledError; the next goes on."""
    lane = Lane(capacity=1, queue_depth=2)
    running = admit(lane, "a")
    victim = admit(lane, "b")
    survivor = admit(lane, "c")
    assert lane.cancel("b") is True
    with pytest.raises(RequestCancelledError):
        await victim.admitted
    assert victim.state == "done"
    assert survivor.position == 1
    assert (lane.active, lane.queued) == (1, 1)
    admit(lane, "b")  # the id and the place are free again
    lane.release(running)
    await asyncio.wait_for(survivor.admitted, 1)
    assert survivor.state == "active"
    assert lane.cancel("nobody") is False


async def test_cancel_running_aborts_once_and_frees_the_slot_on_release():
    """LANE-6: cancelling an active ticket calls on_abort once; the slot frees only on release."""
    lane = Lane(capacity=1)
    aborts: list[str] = []
    running = admit(lane, "a", on_abort=lambda: aborts.append("a"))
    waiter = admit(lane, "b")
    assert lane.cancel("a") is True
    assert lane.cancel("a") is True
    assert aborts == ["a"]
    assert running.cancelled
    assert (running.state, lane.active, waiter.state) == ("active", 1, "queued")
    with pytest.raises(DuplicateRequestError):
        lane.reserve("a")  # still tearing down
    lane.release(running)
    assert waiter.state == "active"
    assert aborts == ["a"]


async def test_cancel_of_a_permit_aborts_it_on_entry():
    """LANE-6: a cancel that arrives before the request entered makes enter raise and frees the budget."""
    lane = Lane(capacity=1, queue_depth=0)
    permit = lane.reserve("a")
    assert lane.cancel("a") is True
    assert lane.probe().saturated
    with pytest.raises(RequestCancelledError):
        lane.enter(permit)
    assert permit.state == "done"
    assert (lane.active, lane.queued, lane.permits) == (0, 0, 0)
    admit(lane, "a")


@pytest.mark.parametrize("stage", ["permit", "queued", "active"])
async def test_duplicate_ids_are_rejected_while_live(stage: str):
    """LANE-5: an id is refused while permitted, queued or active, and accepted after release."""
    lane = Lane(capacity=1)
    holder = admit(lane, "holder")
    ticket = lane.reserve("dup")
    if stage != "permit":
        if stage == "active":
            lane.release(holder)
        lane.enter(ticket)
    assert ticket.state == stage
    with pytest.raises(DuplicateRequestError):
        lane.reserve("dup")
    lane.release(ticket)
    assert lane.reserve("dup").state == "permit"


async def test_writer_waits_for_readers_and_blocks_new_ones():
    """LANE-4: readers queued before a writer run first; the writer runs alone; later readers wait."""
    lane = Lane(capacity=2, queue_depth=8)
    events: list[str] = []
    running = [admit(lane, "r1", events), admit(lane, "r2", events)]
    early = admit(lane, "early", events)
    writer_done = asyncio.Event()

    async def writer() -> None:
        async with lane.exclusive():
            events.append("writer")
            assert lane.active == 0
            await writer_done.wait()

    task = asyncio.create_task(writer())
    await settle()
    late = admit(lane, "late", events)
    assert lane.probe().writers == 1
    assert late.state == "queued"
    lane.release(running[0])
    assert early.state == "active"
    lane.release(running[1])
    await settle()
    assert late.state == "queued"  # a queued writer blocks new readers even with a free slot
    lane.release(early)
    await settle()
    assert events[-1] == "writer"
    assert late.state == "queued"
    writer_done.set()
    await task
    assert late.state == "active"
    assert events == ["r1", "r2", "early", "writer", "late"]
    assert lane.probe().writers == 0


async def test_cancelled_writer_leaves_the_queue():
    """LANE-4: cancelling a waiting writer removes it, and readers behind it go on."""
    lane = Lane(capacity=1)
    running = admit(lane, "a")
    task = asyncio.create_task(_hold(lane))
    await settle()
    behind = admit(lane, "b")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lane.probe().writers == 0
    lane.release(running)
    assert behind.state == "active"


async def test_cancelled_reader_task_releases_its_place():
    """LANE-6: when the task awaiting a queued ticket is cancelled, the caller's release frees it."""
    lane = Lane(capacity=1)
    running = admit(lane, "a")
    gone, behind = admit(lane, "b"), admit(lane, "c")

    async def wait_then_release(ticket: Ticket) -> None:
        try:
            await ticket.admitted
        finally:
            lane.release(ticket)

    task = asyncio.create_task(wait_then_release(gone))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (gone.state, behind.position, lane.queued) == ("done", 1, 1)
    lane.release(running)
    assert behind.state == "active"


async def test_writer_cancelled_just_after_admission_frees_the_lane():
    """LANE-4: a writer whose task is cancelled as it is admitted does not keep the lane."""
    lane = Lane(capacity=1)
    running = admit(lane, "a")
    task = asyncio.create_task(_hold(lane))
    await settle()
    behind = admit(lane, "b")
    lane.release(running)  # admits the writer; its task has not resumed yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lane.probe().writers == 0
    assert behind.state == "active"


async def _hold(lane: Lane) -> None:
    async with lane.exclusive():
        await asyncio.Event().wait()  # holds the lane until the test cancels it


async def test_drain_wait_refuses_fails_waiters_and_waits_for_the_running():
    """LANE-7: drain("wait") refuses at once, fails the queue, returns after the running one ends."""
    lane = Lane(capacity=1)
    aborts: list[str] = []
    running = admit(lane, "a", on_abort=lambda: aborts.append("a"))
    queued = [admit(lane, "b"), admit(lane, "c")]
    permit = lane.reserve("d")
    drain = asyncio.create_task(lane.drain("wait"))
    await settle()
    with pytest.raises(DrainingError):
        lane.reserve("e")
    for ticket in queued:
        with pytest.raises(DrainingError):
            await ticket.admitted
        assert ticket.state == "done"
    with pytest.raises(DrainingError):
        lane.enter(permit)
    assert lane.probe().draining
    assert lane.probe().saturated
    assert not drain.done()
    lane.release(running)
    await asyncio.wait_for(drain, 1)
    assert aborts == []
    assert (lane.active, lane.queued, lane.permits) == (0, 0, 0)
    lane.reopen()
    assert admit(lane, "a").state == "active"


async def test_drain_fails_queued_writers():
    """LANE-7: queued writers get DrainingError too."""
    lane = Lane(capacity=1)
    running = admit(lane, "a")
    task = asyncio.create_task(_hold(lane))
    await settle()
    drain = asyncio.create_task(lane.drain("abort"))
    with pytest.raises(DrainingError):
        await task
    lane.release(running)
    await asyncio.wait_for(drain, 1)
    assert lane.probe().writers == 0


async def test_drain_abort_aborts_running_at_once():
    """LANE-7: drain("abort") calls on_abort on every running ticket immediately."""
    lane = Lane(capacity=2)
    aborts: list[str] = []
    tickets = [admit(lane, rid, on_abort=lambda rid=rid: aborts.append(rid)) for rid in ("a", "b")]
    drain = asyncio.create_task(lane.drain("abort"))
    await settle()
    assert sorted(aborts) == ["a", "b"]
    assert not drain.done()
    for ticket in tickets:
        lane.release(ticket)
    await asyncio.wait_for(drain, 1)
    assert aborts == ["a", "b"]


async def test_drain_wait_aborts_the_rest_at_the_timeout():
    """LANE-7: drain("wait", timeout) lets work finish, then aborts what still runs."""
    lane = Lane(capacity=1)
    aborts: list[str] = []

    def abort() -> None:
        aborts.append("a")
        lane.release(running)  # the worker notices the stop flag and lets go

    running = admit(lane, "a", on_abort=abort)
    await asyncio.wait_for(lane.drain("wait", timeout=0.02), 1)
    assert aborts == ["a"]
    assert lane.active == 0


async def test_queue_timeout_fails_the_waiter_only():
    """LANE-8: a waiter past the queue timeout gets QueueTimeoutError; the slot holder is untouched."""
    lane = Lane(capacity=1, queue_depth=4, queue_timeout_s=0.02)
    running = admit(lane, "a")
    waiter = admit(lane, "b")
    assert lane.queued == 1
    with pytest.raises(QueueTimeoutError) as caught:
        await asyncio.wait_for(waiter.admitted, 1)
    assert caught.value.retry_after >= 1
    assert (running.state, lane.active, lane.queued, waiter.state) == ("active", 1, 0, "done")
    lane.release(running)
    assert lane.active == 0


async def test_admission_before_the_timeout_disarms_it():
    """LANE-8: a waiter admitted in time is not failed later."""
    lane = Lane(capacity=1, queue_timeout_s=0.02)
    running = admit(lane, "a")
    waiter = admit(lane, "b")
    lane.release(running)
    # The thing under test is time passing: wait out the disarmed 0.02 s timer, loop running.
    await asyncio.sleep(0.05)
    assert waiter.state == "active"
    await waiter.admitted


async def test_probe_reports_counters():
    """LANE-9: active, queued, permits, writers, capacity, limit and saturated."""
    lane = Lane(capacity=2, queue_depth=2)
    admit(lane, "a")
    admit(lane, "b")
    admit(lane, "c")
    lane.reserve("d")
    probe = lane.probe()
    assert probe.as_dict() == {
        "active": 2,
        "queued": 1,
        "permits": 1,
        "writers": 0,
        "capacity": 2,
        "limit": 4,
        "saturated": True,
        "draining": False,
    }


async def test_unbounded_lane_never_rejects():
    """LANE-2, LANE-9: `unbounded` opts out of the budget and reports no limit."""
    lane = Lane(capacity=1, queue_depth=0, unbounded=True)
    tickets = [admit(lane, f"r{i}") for i in range(100)]
    probe = lane.probe()
    assert (probe.active, probe.queued, probe.limit, probe.saturated) == (1, 99, None, False)
    assert tickets[-1].position == 99


async def test_configure_raising_capacity_admits_waiters():
    """LANE-1: a larger capacity takes effect at once for queued waiters."""
    lane = Lane(capacity=1, queue_depth=4)
    admit(lane, "a")
    waiters = [admit(lane, "b"), admit(lane, "c"), admit(lane, "d")]
    lane.configure(capacity=3, queue_depth=4, unbounded=False, queue_timeout_s=None)
    assert [t.state for t in waiters] == ["active", "active", "queued"]
    assert waiters[2].position == 1
    assert lane.probe().limit == 7


async def test_a_writer_past_abort_after_goes_first_and_aborts_what_runs():
    """LANE-4, LANE-7: a writer with `abort_after` still waiting at that time moves ahead of the
    readers queued before it and aborts the running one; the readers wait for it, none refused."""
    lane = Lane(capacity=1, queue_depth=4)
    order: list[str] = []
    aborts: list[str] = []
    running = admit(lane, "running", order, on_abort=lambda: aborts.append("running"))
    early = admit(lane, "early", order)
    release = asyncio.Event()

    async def writer() -> None:
        async with lane.exclusive(abort_after=0.01):
            order.append("writer")
            await release.wait()

    task = asyncio.create_task(writer())
    await eventually(lambda: aborts, what="the writer to abort the running reader")
    late = admit(lane, "late", order)
    assert (early.state, late.state, lane.probe().draining) == ("queued", "queued", False)
    lane.release(running)
    await settle()
    assert order[-1] == "writer" and early.state == "queued"
    release.set()
    await task
    lane.release(early)
    assert order == ["running", "writer", "early", "late"]
    assert aborts == ["running"]
