"""Embedding models in the engine with the fake backend (API-13, API-14): batching, lanes, errors."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from mlxhost.engine import (
    EmbeddingFailedError,
    EmbeddingRequest,
    InvalidRequestError,
    LaneSettings,
    ModelSpec,
    QueueFullError,
    WrongModelKindError,
)
from mlxhost.engine.backends.fake import EMBED_END, EMBED_START, fake_vector
from mlxhost.engine.embeddings import plan_passes, truncated
from tests.engine.conftest import collect, lane_idle, lane_of, request, spec, until
from tests.support import FakeClock

NAME = "embedder"


def embedding_spec(capacity: int = 8, queue_depth: int = 16, **overrides) -> ModelSpec:
    return spec(
        1, kind="embedding", lane=LaneSettings(capacity=capacity, queue_depth=queue_depth), **overrides
    )


def embed_request(request_id: str, *texts: str, **fields) -> EmbeddingRequest:
    return EmbeddingRequest(request_id=request_id, binding=NAME, texts=texts, **fields)


def ids_of(text: str) -> list[int]:
    return [EMBED_START, *(ord(ch) for ch in text), EMBED_END]


def ungate(backend) -> None:
    backend.gated = False
    backend.gate.set()


async def test_vectors_come_back_in_input_order_with_their_token_count(engine, backend):
    """API-14: one vector per input, in order; usage counts every input's tokens."""
    engine.bind(NAME, embedding_spec())
    result = await engine.embed(embed_request("e1", "hello", "a longer input", "x"))
    assert [list(v) for v in result.vectors] == [
        list(fake_vector(ids_of(t), 8)) for t in ("hello", "a longer input", "x")
    ]
    assert result.prompt_tokens == sum(len(ids_of(t)) for t in ("hello", "a longer input", "x"))
    assert result.dimensions == 8
    assert len(backend.embed_passes) == 1  # one request's inputs share one forward pass


async def test_concurrent_requests_share_one_forward_pass(make_engine, backend):
    """API-14: requests that arrive together are batched into one pass, results split back."""
    engine = make_engine(embed_wait_s=5.0)  # the wait ends as soon as no permit is outstanding
    engine.bind(NAME, embedding_spec(capacity=8))
    texts = [("one",), ("two", "three"), ("four",), ("five", "six", "seven")]
    results = await asyncio.gather(*(engine.embed(embed_request(f"e{i}", *t)) for i, t in enumerate(texts)))
    assert len(backend.embed_passes) == 1
    assert sorted(map(tuple, backend.embed_passes[0])) == sorted(
        tuple(ids_of(t)) for group in texts for t in group
    )
    for group, result in zip(texts, results, strict=True):
        assert [list(v) for v in result.vectors] == [list(fake_vector(ids_of(t), 8)) for t in group]
        assert result.prompt_tokens == sum(len(ids_of(t)) for t in group)


class WorkerClock(FakeClock):
    """The engine's clock, counting the reads the worker threads make of it."""

    def __init__(self) -> None:
        super().__init__()
        self.worker_reads = 0

    def __call__(self) -> float:
        if threading.current_thread().name.startswith("mlxhost-worker-"):
            self.worker_reads += 1
        return super().__call__()


async def test_the_wait_for_requests_still_tokenizing_ends_on_the_engines_clock(make_engine, backend):
    """API-14: `embed_wait_s` is read on the clock the engine was given, not the wall clock.

    e0 reaches the worker while e-held still tokenizes (holding a permit): the worker waits for it,
    reading the engine's clock as it polls, and advancing that clock past the 30 s ends the wait.
    """
    clock = WorkerClock()
    engine = make_engine(clock=clock, embed_wait_s=30.0)
    engine.bind(NAME, embedding_spec(capacity=8))
    release = threading.Event()
    backend.before_render = lambda _: backend.tokenize_calls > 1 or release.wait(timeout=30)
    held = asyncio.create_task(engine.embed(embed_request("e-held", "held")))
    await until(lambda: backend.tokenize_calls == 1, what="e-held to tokenize, holding its permit")
    reads = clock.worker_reads
    first = asyncio.create_task(engine.embed(embed_request("e0", "first")))
    await until(lambda: clock.worker_reads >= reads + 3, what="the worker to wait on the engine's clock")
    assert backend.embed_passes == [] and lane_of(engine)["permits"] == 1
    clock.advance(31.0)
    result = await asyncio.wait_for(first, 3.0)
    assert [list(v) for v in result.vectors] == [list(fake_vector(ids_of("first"), 8))]
    assert backend.embed_passes == [[ids_of("first")]] and not held.done()
    release.set()
    await held
    assert len(backend.embed_passes) == 2


async def test_requests_arriving_during_a_pass_share_the_next_one(engine, backend):
    """API-14: while one pass runs, the requests admitted meanwhile wait and then go together."""
    engine.bind(NAME, embedding_spec(capacity=8))
    backend.gated = True
    first = asyncio.create_task(engine.embed(embed_request("e0", "first")))
    await until(lambda: backend.parked, what="the first pass to start")
    rest = [asyncio.create_task(engine.embed(embed_request(f"e{i}", f"input {i}"))) for i in range(1, 4)]
    await until(lambda: lane_of(engine)["active"] == 4, what="three more admitted")
    ungate(backend)
    await asyncio.gather(first, *rest)
    assert [len(p) for p in backend.embed_passes] == [1, 3]


async def test_a_full_lane_refuses_at_once(engine, backend):
    """LANE-2, API-14: over capacity + queue depth, an embedding request is refused with 429's error."""
    engine.bind(NAME, embedding_spec(capacity=1, queue_depth=1))
    backend.gated = True
    running = asyncio.create_task(engine.embed(embed_request("e0", "a")))
    await until(lambda: backend.parked, what="the first pass to start")
    queued = asyncio.create_task(engine.embed(embed_request("e1", "b")))
    await until(lambda: lane_of(engine)["queued"] == 1, what="the second to queue")
    with pytest.raises(QueueFullError):
        await engine.embed(embed_request("e2", "c"))
    ungate(backend)
    await asyncio.gather(running, queued)
    [(_, _, stats)] = engine.stats.requests()
    assert stats.rejected["queue_full"] == 1


async def test_an_input_over_the_limit_is_named_by_index(engine, backend):
    """API-14: a too-long input is a 400 naming `input[i]`, before the request takes a slot."""
    backend.embedding_max_tokens = 10
    engine.bind(NAME, embedding_spec())
    with pytest.raises(InvalidRequestError) as caught:
        await engine.embed(embed_request("e1", "short", "much too long for it"))
    assert caught.value.param == "input[1]"
    with pytest.raises(InvalidRequestError) as caught:  # the alias's own limit is lower
        await engine.embed(embed_request("e2", "short", "fits", max_input_tokens=6))
    assert caught.value.param == "input[0]"
    assert backend.embed_passes == []
    await lane_idle(engine)


@pytest.mark.parametrize(
    ("dimensions", "truncatable", "allowed"),
    [
        pytest.param(8, False, True, id="all-of-them"),
        pytest.param(4, True, True, id="fewer-when-matryoshka"),
        pytest.param(4, False, False, id="fewer-refused"),
        pytest.param(9, True, False, id="more-refused"),
    ],
)
async def test_dimensions_truncate_and_renormalise_where_allowed(engine, dimensions, truncatable, allowed):
    """API-14: `dimensions` below the width truncates and renormalises on a Matryoshka model;
    more than the width, or fewer on another model, is a 400 naming `dimensions`."""
    engine.bind(NAME, embedding_spec())
    ask = embed_request("e1", "hello", dimensions=dimensions, truncatable=truncatable)
    if not allowed:
        with pytest.raises(InvalidRequestError) as caught:
            await engine.embed(ask)
        assert caught.value.param == "dimensions"
        return
    [vector] = (await engine.embed(ask)).vectors
    assert len(vector) == dimensions
    assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-5)
    assert list(vector) == list(truncated(fake_vector(ids_of("hello"), 8), dimensions))


async def test_each_kind_refuses_the_other_kinds_requests(engine):
    """API-13: a chat request on an embedding model, and an embedding request on a chat model, are refused."""
    engine.bind(NAME, embedding_spec())
    with pytest.raises(WrongModelKindError, match="embedding model"):
        await engine.submit(request("c1", binding=NAME))
    with pytest.raises(WrongModelKindError):
        await engine.count_tokens(request("c2", binding=NAME))
    engine.bind("chat", spec(2))
    with pytest.raises(WrongModelKindError, match="chat model"):
        await engine.embed(EmbeddingRequest(request_id="e1", binding="chat", texts=("hi",)))
    await lane_idle(engine)
    await lane_idle(engine, 2)


async def test_chat_models_still_generate_beside_an_embedding_model(engine, backend):
    """API-13: both kinds live in one engine, each on its own instance and lane."""
    engine.bind(NAME, embedding_spec())
    chat = await engine.submit(request("c1", instance_id=2, max_tokens=2))
    result = await engine.embed(embed_request("e1", "hello"))
    assert len(result.vectors) == 1
    assert len(await collect(chat)) > 0
    kinds = {snap["instance_id"]: snap["kind"] for snap in engine.snapshot()}
    assert kinds == {1: "embedding", 2: "chat"}


async def test_a_failed_pass_fails_its_requests_and_the_next_one_works(engine, backend):
    """API-4, OPS-2: the backend's failure is an EmbeddingFailedError, counted; the next request runs."""
    engine.bind(NAME, embedding_spec())
    backend.embed_failures = 1
    with pytest.raises(EmbeddingFailedError):
        await engine.embed(embed_request("e1", "hello"))
    assert len((await engine.embed(embed_request("e2", "hello"))).vectors) == 1
    [(_, _, stats)] = engine.stats.embeddings()
    assert stats.outcomes == {"completed": 1, "cancelled": 0, "failed": 1}
    await lane_idle(engine)


async def test_a_cancelled_waiter_frees_its_slot(engine, backend):
    """LANE-6, API-14: a caller that gives up while queued leaves the lane at once and never runs."""
    engine.bind(NAME, embedding_spec(capacity=1))
    backend.gated = True
    running = asyncio.create_task(engine.embed(embed_request("e0", "a")))
    await until(lambda: backend.parked, what="the first pass to start")
    waiter = asyncio.create_task(engine.embed(embed_request("e1", "b")))
    await until(lambda: lane_of(engine)["queued"] == 1, what="the second to queue")
    waiter.cancel()
    await until(lambda: lane_of(engine)["queued"] == 0, what="the waiter to leave")
    ungate(backend)
    await running
    assert [len(p) for p in backend.embed_passes] == [1]
    [(_, _, stats)] = engine.stats.embeddings()
    assert stats.outcomes["cancelled"] == 1


async def test_counts_inputs_tokens_and_latency_per_binding(engine):
    """OPS-1: embedding requests, inputs, tokens and latency are counted per alias and instance."""
    engine.bind(NAME, embedding_spec())
    await engine.embed(embed_request("e1", "ab", "c"))
    await engine.embed(embed_request("e2", "d"))
    [(name, instance_id, stats)] = engine.stats.embeddings()
    assert (name, instance_id) == (NAME, 1)
    assert stats.outcomes["completed"] == 2
    assert (stats.inputs, stats.tokens) == (3, 4 + 3 + 3)
    assert stats.latency_s.count == 2
    [snap] = engine.snapshot()
    assert snap["embeddings"] == {"passes": 2, "inputs": 3, "tokens": 10}


async def test_keep_alive_frees_an_idle_embedding_model_and_the_next_request_loads_it(engine, backend):
    """OPS-3, API-13: keep-alive and reloads apply to embedding models as to chat models."""
    engine.bind(NAME, embedding_spec(keep_alive_s=0.0))
    await engine.embed(embed_request("e1", "hello"))
    assert await engine.unload_idle() == [1]
    assert engine.get(1).state == "unloaded"
    await engine.embed(embed_request("e2", "hello"))
    assert backend.loads == [1, 1]


def test_passes_group_inputs_by_length_within_the_token_bound():
    """API-14: a pass holds at most `max_tokens` padded tokens; inputs go in by length."""
    assert plan_passes([3, 10, 2, 9], max_tokens=100) == [[2, 0, 3, 1]]
    assert plan_passes([3, 10, 2, 9], max_tokens=20) == [[2, 0], [3, 1]]
    assert plan_passes([50], max_tokens=10) == [[0]]  # one input always fits a pass


def test_a_pass_is_cut_where_padding_would_cost_more_than_another_pass():
    """API-14: close lengths share a pass; short inputs are not padded far up to long ones."""
    assert len(plan_passes([7, 8, 9, 10, 11, 12], pass_cost=32)) == 1
    lengths = [10] * 64 + [40] * 64
    passes = plan_passes(lengths, pass_cost=32)
    assert [sorted({lengths[p] for p in group}) for group in passes] == [[10], [40]]
    assert plan_passes([8, 12, 16, 20, 24, 30, 38, 45], pass_cost=32) == [[0, 1, 2, 3, 4, 5], [6, 7]]


async def test_the_memory_budget_evicts_an_idle_embedding_model_like_a_chat_model(make_engine, backend):
    """OPS-3, API-13: embedding weights count in the memory budget and are evicted when idle."""
    engine = make_engine(memory_budget_bytes=1500)  # room for one fake model (1024 bytes)
    engine.bind(NAME, embedding_spec())
    await engine.embed(embed_request("e1", "hello"))
    assert engine.resident_bytes() == 1024
    await collect(await engine.submit(request("c1", instance_id=2, max_tokens=1)))
    assert engine.get(1).state == "unloaded"
    assert engine.stats.unloads[1]["memory_budget"] == 1
