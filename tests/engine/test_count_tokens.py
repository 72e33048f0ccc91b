"""`Engine.count_tokens`: renders like `submit`, but never enters the lane and never generates."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine import (
    DrainingError,
    GenerationRequest,
    LaneSettings,
    Message,
    ModelLoadError,
    QueueFullError,
    SamplingParams,
    Started,
)
from tests.engine.conftest import lane_idle, lane_of, next_event, request, spec

PROMPT = "<user>hi<assistant>"  # the fake backend's rendering of request()'s single message


async def test_counts_the_rendered_chat_prompt_without_generating(engine, backend):
    """API-2: count_tokens is the length of the templated prompt that a submit would feed."""
    messages = (Message(role="system", content="Be brief."), Message(role="user", content="hi"))
    count = await engine.count_tokens(request(messages=messages))
    assert count == len("<system>Be brief.<user>hi<assistant>")
    assert backend.render_calls == 1
    assert backend.history == []  # nothing was generated
    assert backend.tokens_generated == 0


async def test_counts_a_raw_prompt_by_encoding_it(engine, backend):
    engine.bind("raw", spec())
    raw = GenerationRequest(request_id="r", binding="raw", sampling=SamplingParams(), prompt="abcdef")
    assert await engine.count_tokens(raw) == 6
    assert backend.render_calls == 0


async def test_a_count_matches_the_prompt_tokens_of_the_generation(engine, backend):
    backend.enqueue(["x"])
    counted = await engine.count_tokens(request("count"))
    started = await next_event((await engine.submit(request("gen"))).stream())
    assert isinstance(started, Started)
    assert counted == started.prompt_tokens == len(PROMPT)


async def test_a_count_is_answered_while_the_lane_is_full(engine, backend):
    """LANE-2: a count takes no permit, so a saturated lane neither refuses nor queues it."""
    full = spec(1, lane=LaneSettings(capacity=1, queue_depth=0))
    backend.gated = True
    generation = await engine.submit(request("holder", spec_=full, max_tokens=1000))
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    with pytest.raises(QueueFullError):
        await engine.submit(request("refused", spec_=full))

    assert await asyncio.wait_for(engine.count_tokens(request("count", spec_=full)), 3) == len(PROMPT)
    lane = lane_of(engine)
    assert (lane["active"], lane["queued"], lane["permits"]) == (1, 0, 0)

    await stream.aclose()
    backend.gate.set()
    await lane_idle(engine)


async def test_a_count_is_not_held_to_max_input_tokens(engine, backend):
    assert await engine.count_tokens(request(max_input_tokens=3)) == len(PROMPT)


async def test_a_count_loads_the_model_and_reports_a_failed_load(engine, backend):
    backend.load_failures = 1
    with pytest.raises(ModelLoadError, match="fake load failure"):
        await engine.count_tokens(request())
    assert await engine.count_tokens(request()) == len(PROMPT)
    assert backend.loads == [1]


async def test_a_count_after_shutdown_is_refused(engine):
    await engine.shutdown()
    with pytest.raises(DrainingError):  # the client hears 503 draining / 529, as during the drain
        await engine.count_tokens(request())


async def test_a_count_on_an_unbound_name_leaves_no_lease_behind(engine, backend):
    """REG-6: the count's registry lease is returned, so an unbind tears the instance down."""
    await engine.count_tokens(request(binding="alias-a"))
    assert engine.registry.holds(engine.get(1)).leases == 0
    engine.unbind("alias-a")
    assert engine.snapshot() == []
