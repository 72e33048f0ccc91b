"""Constrained decoding and logprobs with the real tiny MLX model: exclusive and batched alike."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mlxhost.engine import Delta, Done, InvalidRequestError, Message
from mlxhost.engine.types import Tool, ToolCallDelta, ToolChoice
from tests.engine.conftest import collect
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


@pytest.fixture
def tools_model(tiny_tools_model_dir):
    from mlxhost.engine import ModelSpec
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    model = MlxBackend().load(ModelSpec(1, str(tiny_tools_model_dir), "f" * 64), lambda *a: None)
    yield model
    model.close()


def test_a_tool_template_is_detected_and_renders_tools_calls_and_results(tools_model):
    """API-6: mlx-lm's tokenizer wrapper finds the template's tool format; tools, a past call and
    its result render through the template itself."""
    from mlxhost.engine import Message
    from mlxhost.engine.types import ToolCall

    assert tools_model.knows_tools
    history = [
        Message("user", "weather?"),
        Message("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
        Message("tool", "rain", tool_call_id="c1", name="get_weather"),
    ]
    ids = tools_model.render_chat(history, tools=[WEATHER], options={"enable_thinking": False})
    text = tools_model._tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_models_own_parser_reads_scripted_calls_and_thinking(tools_model):
    """mlx-lm's text state machine and json_tools parser, on scripted output split mid-marker."""
    prompt = tools_model.render_chat([Message("user", "hi")], options={"enable_thinking": True})
    splitter = tools_model.splitter(prompt)
    pieces = [
        "Hmm, wea",
        "ther.</thi",
        "nk>Let me check.<tool_",
        'call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    ]
    segments = [seg for piece in pieces for seg in splitter.split(piece)] + splitter.flush()
    by_state: dict[str, str] = {}
    for state, text in segments:
        by_state[state] = by_state.get(state, "") + text
    assert by_state["reasoning"] == "Hmm, weather."
    assert by_state["normal"] == "Let me check."
    assert splitter.parse_calls(by_state["tool"], (WEATHER,)) == [("get_weather", '{"city": "Oslo"}')]


async def test_thinking_opened_by_the_template_is_reasoning_not_answer(tiny_tools_model_dir):
    """API-9: with `enable_thinking` the template opens a thinking block, so what the model then
    writes is reasoning until it closes it (the random model never does within 6 tokens)."""
    from mlxhost.engine import Engine, EngineConfig, LaneSettings, ModelSpec
    from mlxhost.engine.types import ReasoningDelta

    engine = Engine(EngineConfig(backend="mlx"))
    spec = ModelSpec(1, str(tiny_tools_model_dir), "f" * 64, lane=LaneSettings(capacity=1))
    await engine.load(spec)
    try:
        thinking = replace(
            chat(spec, "t1", [("user", "hi")], max_tokens=6), template_options=(("enable_thinking", True),)
        )
        events = await collect(await engine.submit(thinking))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning and _text(events) == "" and events[-1].reasoning == reasoning
        plain = replace(thinking, request_id="t2", template_options=(("enable_thinking", False),))
        events = await collect(await engine.submit(plain))
        assert _text(events) and not any(isinstance(e, ReasoningDelta) for e in events)
    finally:
        await engine.shutdown()
