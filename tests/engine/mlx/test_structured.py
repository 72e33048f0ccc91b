"""Constrained decoding and logprobs with the real tiny MLX model: exclusive and batched alike."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mlxhost.engine import Delta, Done, InvalidRequestError
from mlxhost.engine.types import Tool, ToolCallDelta, ToolChoice
from tests.engine.mlx.support import chat, run_together

pytestmark = pytest.mark.timeout(120)

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
)


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.mark.parametrize("capacity", [1, 4])
async def test_a_json_schema_answer_always_parses_and_matches(engines, capacity):
    """A random-weights model, asked for JSON under a schema, answers JSON that validates, on the
    exclusive (capacity 1) and the batched scheduler, greedy and sampled."""
    engine, spec = await engines(capacity)
    requests = [
        replace(
            chat(spec, f"j{i}", [("user", f"describe {i}")], max_tokens=200, temperature=t),
            json_format=SCHEMA,
        )
        for i, t in enumerate([0.0, 1.0, 1.0, 0.7])
    ]
    for events in await run_together(engine, requests):
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason == "stop", done
        value = json.loads(_text(events))
        assert set(value) == {"name", "tags"} and all(tag in ("a", "b") for tag in value["tags"])


@pytest.mark.parametrize("capacity", [1, 3])
async def test_a_forced_call_is_valid_json_for_its_schema(engines, capacity):
    engine, spec = await engines(capacity)
    base = chat(spec, "c", [("user", "weather in Paris?")], max_tokens=120, temperature=1.0)
    requests = [
        replace(base, request_id=f"c{i}", tools=(WEATHER,), tool_choice=ToolChoice("required"))
        for i in range(3)
    ]
    for events in await run_together(engine, requests):
        done = events[-1]
        assert done.finish_reason == "tool_calls", done
        (call,) = done.tool_calls
        arguments = json.loads(call.arguments)
        assert call.name == "get_weather" and set(arguments) == {"city", "days"}
        assert isinstance(arguments["days"], int) and len(arguments["city"]) <= 12
        streamed = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
        assert streamed == call.arguments
        assert _text(events) == ""


async def test_a_schema_the_engine_cannot_enforce_is_refused_before_admission(engines):
    engine, spec = await engines(1)
    bad = replace(
        chat(spec, "bad", [("user", "x")]),
        json_format='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}',
    )
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(bad)
    assert refused.value.param == "response_format"
    assert "schema" in str(refused.value)


async def test_logprobs_come_with_every_token_exclusive_and_batched(engines):
    for capacity in (1, 2):
        engine, spec = await engines(capacity)
        request = chat(spec, f"lp{capacity}", [("user", "the river")], max_tokens=6, logprobs=3)
        (events,) = await run_together(engine, [request])
        deltas = [e for e in events if isinstance(e, Delta)]
        ids = [t for d in deltas for t in d.token_ids]
        logprobs = [lp for d in deltas for lp in d.logprobs]
        assert len(logprobs) == len(ids) == events[-1].usage.completion_tokens
        for lp in logprobs:
            assert lp.logprob <= 0 and len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.top[0].logprob == pytest.approx(lp.logprob, abs=1e-4)  # greedy: the best one
        assert "".join(lp.token for lp in logprobs) == "".join(d.text for d in deltas)
