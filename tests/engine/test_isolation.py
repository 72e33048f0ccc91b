"""Per-request fault isolation and bounded work (OPS-2): what one request sets or breaks stays its own."""

from __future__ import annotations

import math

import pytest

from mlxhost.engine import (
    Delta,
    Done,
    Failed,
    InvalidRequestError,
    LaneSettings,
    PromptTooLongError,
    RequestTooLargeError,
)
from mlxhost.engine.backends.fake import BYTES_PER_TOKEN, FAULT
from tests.engine.conftest import collect, lane_idle, request, spec, until

BATCHED = spec(1, lane=LaneSettings(capacity=4))


def text_of(events) -> str:
    return "".join(event.text for event in events if isinstance(event, Delta))


def faults(engine) -> dict:
    (snap,) = engine.snapshot()
    return snap["faults"]  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        pytest.param({"logit_bias": ((10**7, 5.0),)}, "logit_bias", id="token-id-past-the-vocabulary"),
        pytest.param({"logit_bias": ((-1, 5.0),)}, "logit_bias", id="negative-token-id"),
        pytest.param({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias", id="too-many-ids"),
        pytest.param({"logit_bias": ((3, math.inf),)}, "logit_bias", id="infinite-bias"),
        pytest.param({"temperature": math.nan}, "temperature", id="nan-temperature"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-over-one"),
        pytest.param({"min_p": -0.1}, "min_p", id="negative-min-p"),
        pytest.param({"repetition_penalty": 0.0}, "repetition_penalty", id="zero-repetition-penalty"),
        pytest.param({"presence_penalty": 9.0}, "presence_penalty", id="presence-penalty-over-two"),
        pytest.param({"top_k": -1}, "top_k", id="negative-top-k"),
        pytest.param({"seed": 2**64}, "seed", id="seed-past-64-bits"),
    ],
)
async def test_a_value_the_model_cannot_use_is_refused_before_templating(engine, backend, sampling, param):
    """OPS-2: a bad sampling value is an InvalidRequestError naming the field, before any work; the lane is left empty and the next request is served."""
    with pytest.raises(InvalidRequestError) as caught:
        await engine.submit(request("bad", **sampling))
    assert caught.value.param == param
    assert backend.render_calls == 0 and backend.history == []
    await lane_idle(engine)
    events = await collect(await engine.submit(request("next", max_tokens=2)))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 2


async def test_top_k_at_or_over_the_vocabulary_keeps_every_token(engine, backend):
    """OPS-2: top_k >= vocabulary size means "no filter" (0), never a value mlx-lm raises on."""
    backend.vocab_size = 1000
    for top_k in (999, 1000, 2**31 - 1):
        await collect(await engine.submit(request(f"k{top_k}", top_k=top_k, max_tokens=1)))
    assert [h[2].top_k for h in backend.history] == [999, 0, 0]


async def test_a_logit_bias_inside_the_vocabulary_reaches_the_model(engine, backend):
    backend.vocab_size = 1000
    await collect(await engine.submit(request("ok", logit_bias=((0, -5.0), (999, 5.0)), max_tokens=1)))
    assert backend.history[0][2].logit_bias == ((0, -5.0), (999, 5.0))


async def test_the_context_length_bounds_the_prompt_and_cuts_max_tokens(engine, backend):
    """OPS-2: the model's context is the default input limit; the output is cut to the room left."""
    backend.context_length = 40
    prompt = "x" * 20  # "<user>" + 20 + "<assistant>": 37 tokens
    await collect(await engine.submit(request("fits", text=prompt, max_tokens=100)))
    assert backend.history[-1][2].max_tokens == 3
    with pytest.raises(PromptTooLongError) as caught:
        await engine.submit(request("long", text="x" * 23, max_tokens=1))
    assert (caught.value.prompt_tokens, caught.value.limit) == (40, 39)
    assert len(backend.history) == 1


async def test_the_alias_limit_lowers_the_context_limit(engine, backend):
    backend.context_length = 1000
    with pytest.raises(PromptTooLongError) as caught:
        await engine.submit(request("long", max_input_tokens=10, text="x" * 20))
    assert caught.value.limit == 10


async def test_a_request_whose_kv_cannot_fit_is_refused_before_admission(make_engine, backend):
    """OPS-2: prompt plus max_tokens is costed in KV bytes against the budget before the lane."""
    backend.kv_bytes_per_token = BYTES_PER_TOKEN
    engine = make_engine(max_request_kv_bytes=BYTES_PER_TOKEN * 100)
    prompt_tokens = len("<user>hi<assistant>")
    await collect(await engine.submit(request("fits", max_tokens=100 - prompt_tokens)))
    with pytest.raises(RequestTooLargeError):
        await engine.submit(request("big", max_tokens=101 - prompt_tokens))
    assert len(backend.history) == 1
    await lane_idle(engine)


async def test_a_failing_sequence_in_a_batch_fails_alone(engine, backend):
    """OPS-2: one sequence's own failure (its sampler raising) ends it alone; the rest of the batch finishes, and the instance is not degraded."""
    backend.gated = True
    backend.enqueue(["a", "b", "c"])
    backend.enqueue(["d", FAULT, "never"])
    backend.enqueue(["e", "f", "g"])
    generations = [await engine.submit(request(f"r{i}", spec_=BATCHED, max_tokens=5)) for i in range(3)]
    backend.gated = False
    backend.gate.set()
    results = [await collect(g) for g in generations]
    assert [text_of(r) for r in results] == ["abc", "d", "efg"]
    assert isinstance(results[1][-1], Failed) and results[1][-1].code == "generation_failed"
    assert [type(r[-1]) for r in (results[0], results[2])] == [Done, Done]
    assert faults(engine)["in_a_row"] == 0 and faults(engine)["total"] == 0
    await lane_idle(engine)


async def test_an_unattributed_batch_failure_degrades_then_recovers(engine, backend):
    """OPS-2: a batch step that fails with nobody to blame ends that batch, marks the instance degraded and rebuilds its state; the next request is served and clears it."""
    backend.batch_step_failures = 1
    failed = await collect(await engine.submit(request("r0", spec_=BATCHED, max_tokens=3)))
    assert isinstance(failed[-1], Failed)
    # The requests hear of the failure first; the worker then counts it and recovers.
    await until(lambda: faults(engine)["recoveries"] == 1, what="the recovery")
    assert faults(engine) == {
        "total": 1,
        "in_a_row": 1,
        "last": "RuntimeError",
        "recoveries": 1,
        "reloads": 0,
    }
    assert engine.snapshot()[0]["state"] == "ready"
    served = await collect(await engine.submit(request("r1", spec_=BATCHED, max_tokens=3)))
    assert isinstance(served[-1], Done) and served[-1].usage.completion_tokens == 3
    await until(lambda: faults(engine)["in_a_row"] == 0, what="the fault to be cleared")
    assert backend.recoveries == 1


async def test_repeated_failures_load_the_model_afresh(make_engine, backend):
    """OPS-2: after `reload_after_faults` failures in a row the worker drops the model and loads it again, instead of failing every later request."""
    engine = make_engine(reload_after_faults=3)
    backend.generate_failures = 3
    for i in range(3):
        events = await collect(await engine.submit(request(f"f{i}", max_tokens=2)))
        assert isinstance(events[-1], Failed)
    await until(lambda: backend.loads == [1, 1], what="the reload")
    assert faults(engine)["reloads"] == 1
    assert faults(engine)["in_a_row"] == 3  # degraded until a generation finishes cleanly
    events = await collect(await engine.submit(request("ok", max_tokens=2)))
    assert isinstance(events[-1], Done)
    assert faults(engine)["in_a_row"] == 0
