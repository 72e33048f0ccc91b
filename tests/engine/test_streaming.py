"""Event delivery from the worker thread to the reader: order, exact token ids, and Delta coalescing."""

from __future__ import annotations

import asyncio
import threading

from mlxhost.engine import Delta, Done, Generation, Started, Timings, Usage
from tests.engine.conftest import collect, lane_idle, next_event, request

DONE = Done(finish_reason="length", usage=Usage(3, 3), timings=Timings(0.0, 0.0, 0.0, 0.0))


def post_from_a_thread(generation: Generation, events) -> None:
    """Post `events` from another thread while the loop is blocked, as a fast worker would."""
    thread = threading.Thread(target=lambda: [generation.post_threadsafe(e) for e in events])
    thread.start()
    thread.join()  # blocks the loop: nothing is delivered until every event is posted


async def test_a_burst_from_the_worker_coalesces_into_one_delta_and_one_loop_wakeup(monkeypatch):
    """Unread Deltas merge (texts joined, token ids in order); the burst costs one loop callback."""
    loop = asyncio.get_running_loop()
    calls = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *args: calls.append(args) or real(*args))
    generation = Generation(request(), loop)
    burst = [Started(prompt_tokens=3), Delta("a", (1,)), Delta("", (2,)), Delta("bc", (3, 4)), DONE]
    post_from_a_thread(generation, burst)
    assert len(calls) == 1
    events = await collect(generation)
    assert events == [Started(prompt_tokens=3), Delta("abc", (1, 2, 3, 4)), DONE]


async def test_one_batch_step_for_many_requests_wakes_the_loop_once(monkeypatch):
    """Events posted to several generations in one burst (a batch step) share one loop callback."""
    loop = asyncio.get_running_loop()
    calls = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *args: calls.append(args) or real(*args))
    generations = [Generation(request(f"r{i}"), loop) for i in range(8)]

    def step() -> None:
        for i, generation in enumerate(generations):
            generation.post_threadsafe(Delta(f"t{i}", (i,)))
            generation.post_threadsafe(DONE)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert len(calls) == 1
    results = await asyncio.gather(*(collect(g) for g in generations))
    assert results == [[Delta(f"t{i}", (i,)), DONE] for i in range(8)]


async def test_deltas_never_merge_across_other_events():
    """Order is kept: a Delta joins only the Delta right before it, never one before a Started or Done."""
    generation = Generation(request(), asyncio.get_running_loop())
    post_from_a_thread(generation, [Delta("a", (1,)), Started(prompt_tokens=1), Delta("b", (2,))])
    await asyncio.sleep(0)  # the scheduled flush runs
    generation.post(Delta("c", (3,)))  # loop side joins the unread tail too
    generation.post(DONE)
    assert await collect(generation) == [
        Delta("a", (1,)),
        Started(prompt_tokens=1),
        Delta("bc", (2, 3)),
        DONE,
    ]


async def test_a_reader_that_keeps_up_gets_one_delta_per_token(engine, backend):
    """Coalescing only happens when the reader lags: read promptly, every token is its own Delta."""
    backend.enqueue(["Hel", "lo", "!"])
    backend.gated = True
    stream = (await engine.submit(request(max_tokens=10))).stream()
    assert isinstance(await next_event(stream), Started)
    texts = []
    for _ in range(3):
        backend.gate.set()
        event = await next_event(stream)
        assert isinstance(event, Delta)
        texts.append((event.text, len(event.token_ids)))
    assert texts == [("Hel", 1), ("lo", 1), ("!", 1)]
    assert [event async for event in stream][-1].finish_reason == "stop"


async def test_a_slow_reader_gets_everything_in_fewer_deltas(engine, backend):
    """A reader that falls behind gets the same text and token ids in fewer, larger Deltas."""
    generation = await engine.submit(request(max_tokens=2000))
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    # The worker runs ahead meanwhile: it has posted every token (and freed the slot) before we read on.
    await lane_idle(engine)
    events = [event async for event in stream]
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == "tok " * 2000
    assert sum(len(d.token_ids) for d in deltas) == 2000
    assert len(deltas) < 2000
    assert events[-1].usage.completion_tokens == 2000


async def test_end_listeners_hear_the_terminal_event_once_whether_or_not_it_is_read(caplog):
    """KEY-2: usage is tallied as the engine posts the end, not when a client reads it; a listener
    that raises is logged and never stops the answer; a late listener hears it at once."""
    generation = Generation(request(), asyncio.get_running_loop())
    heard: list[object] = []

    def broken(_event: object) -> None:
        raise RuntimeError("listener bug")

    generation.add_end_listener(broken)
    generation.add_end_listener(heard.append)
    post_from_a_thread(generation, [Started(prompt_tokens=3), Delta("a", (1,)), DONE])
    await asyncio.sleep(0)  # the courier's one callback delivers them; nobody reads the stream
    assert heard == [DONE]
    assert "end listener" in caplog.text
    generation.post(DONE)  # a second terminal event is never heard twice
    late: list[object] = []
    generation.add_end_listener(late.append)
    assert heard == [DONE] and late == [DONE]
    assert [type(e).__name__ for e in await collect(generation)][-1] == "Done"
