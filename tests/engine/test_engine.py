"""Engine behaviour against the fake backend: streaming, stops, cancellation, loading, sharing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxhost.engine import Delta, Done, Failed, ModelLoadError, PromptTooLongError, Started
from mlxhost.engine.backends.fake import GENERATED_ID_BASE
from tests.engine.conftest import request, spec, until


async def collect(generation):
    return [event async for event in generation.stream()]


async def test_streams_scripted_tokens_then_done(engine, backend):
    backend.enqueue(["Hel", "lo", "!"])
    events = await collect(await engine.submit(request(max_tokens=10)))
    assert isinstance(events[0], Started)
    assert events[0].prompt_tokens == len("<user>hi<assistant>")
    deltas = [e for e in events if isinstance(e, Delta)]
    # Deltas the reader had not taken yet coalesce into fewer events; text and token ids stay exact.
    assert "".join(e.text for e in deltas) == "Hello!"
    assert [i for e in deltas for i in e.token_ids] == [GENERATED_ID_BASE + i for i in range(3)]
    done = events[-1]
    assert isinstance(done, Done)
    assert done.finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (19, 3)


async def test_max_tokens_ends_with_length(engine, backend):
    events = await collect(await engine.submit(request(max_tokens=4)))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "tok " * 4
    assert events[-1].finish_reason == "length"
    assert backend.tokens_generated == 4


async def test_stop_sequence_cuts_text_and_is_never_emitted(engine, backend):
    backend.enqueue(["The ", "ans", "wer. ", "EN", "D here", " more"])
    events = await collect(await engine.submit(request(max_tokens=50, stop=("END",))))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "The answer. "
    assert events[-1].finish_reason == "stop"
    assert backend.tokens_generated == 5  # generation stopped at the matching token


async def test_closing_the_stream_stops_the_worker_within_one_token(engine, backend):
    backend.gated = True
    generation = await engine.submit(request(max_tokens=10_000))
    stream = generation.stream()
    assert isinstance(await anext(stream), Started)
    backend.gate.set()
    assert isinstance(await anext(stream), Delta)
    await stream.aclose()  # what a client disconnect does to the view's generator
    assert generation.stop_flag.is_set()
    backend.gate.set()  # let the worker take at most one more step
    instance = engine.get(1)
    await until(lambda: instance.stats.active_request is None, what="the worker to drop the request")
    assert backend.tokens_generated <= 2
    assert instance.stats.requests_cancelled == 1


async def test_cancelling_the_consumer_task_sets_the_stop_flag(engine, backend):
    backend.gated = True
    generation = await engine.submit(request(max_tokens=10_000))

    seen: list[object] = []

    async def consume():
        async for event in generation.stream():
            seen.append(event)

    task = asyncio.create_task(consume())
    await until(lambda: seen, what="the consumer to be reading the stream")  # it got Started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert generation.stop_flag.is_set()
    backend.gate.set()


async def test_requests_run_in_fifo_order_on_one_worker(engine, backend):
    backend.enqueue(["a"])
    backend.enqueue(["b"])
    first = await engine.submit(request("r1", text="one"))
    second = await engine.submit(request("r2", text="two"))
    results = await asyncio.gather(collect(second), collect(first))
    assert [e.text for e in results[1] if isinstance(e, Delta)] == ["a"]
    assert [e.text for e in results[0] if isinstance(e, Delta)] == ["b"]


async def test_two_specs_with_one_instance_id_share_one_load(engine, backend):
    """REG-2: loading is by instance; two registrations of the same instance share one model."""
    await asyncio.gather(engine.load(spec(7)), engine.load(spec(7)), engine.submit(request(instance_id=7)))
    assert backend.loads == [7]
    assert len(engine.snapshot()) == 1


async def test_load_failure_is_reported_with_reason_and_can_be_retried(engine, backend):
    backend.load_failures = 1
    with pytest.raises(ModelLoadError, match="fake load failure"):
        await engine.load(spec(3))
    assert engine.get(3).state == "error"
    assert "OSError" in engine.get(3).last_error
    await engine.load(spec(3))
    assert engine.get(3).state == "ready"


async def test_prompt_over_max_input_tokens_is_refused_before_queueing(engine, backend):
    req = request("long", text="x" * 50, max_input_tokens=20)
    with pytest.raises(PromptTooLongError) as info:
        await engine.submit(req)
    assert info.value.limit == 20
    assert backend.history == []


async def test_worker_exception_becomes_a_failed_event(engine, backend, monkeypatch):
    await engine.load(spec(1))
    model = engine.get(1).model

    def explode(prompt_ids, sampling):
        raise RuntimeError("/secret/path boom")
        yield  # pragma: no cover

    monkeypatch.setattr(model, "generate", explode)
    events = await collect(await engine.submit(request()))
    assert isinstance(events[-1], Failed)
    assert "/secret" not in events[-1].message


async def test_unload_frees_the_model_and_next_request_reloads(engine, backend):
    await collect(await engine.submit(request()))
    await engine.unload(1)
    assert engine.get(1).state == "unloaded"
    assert engine.get(1).model is None
    await collect(await engine.submit(request("r2")))
    assert backend.loads == [1, 1]


async def test_each_instance_has_its_own_worker_thread(engine, backend):
    await engine.load(spec(1))
    await engine.load(spec(2))
    names = {t.name for t in threading.enumerate() if t.name.startswith("mlxhost-worker-")}
    assert {"mlxhost-worker-1", "mlxhost-worker-2"} <= names
