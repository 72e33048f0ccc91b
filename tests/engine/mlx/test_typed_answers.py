"""Tools with a typed (JSON) answer, and schemas refused before admission, on the real tiny model."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import pytest

from mlxhost.engine import (
    Delta,
    Done,
    Engine,
    EngineConfig,
    InvalidRequestError,
    LaneSettings,
    Message,
    ModelSpec,
)
from mlxhost.engine.types import Tool, ToolCall, ToolChoice
from tests.engine.conftest import collect
from tests.engine.mlx.support import chat, run_together
from tests.engine.mlx.test_structured import SCHEMA, WEATHER

pytestmark = pytest.mark.timeout(180)

RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MUTUAL = {
    "$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
    },
    "$ref": "#/$defs/A",
}
EXPLODING = {
    "type": "object",
    "properties": {"s": {"type": "string", "pattern": "^a{1000}{1000}$"}},
    "required": ["s"],
}
SELF = {"$ref": "#"}
UNSERVABLE = [
    pytest.param(RECURSIVE, id="recursive-required"),
    pytest.param(MUTUAL, id="mutual-recursion"),
    pytest.param(EXPLODING, id="exploding-pattern"),
    pytest.param(SELF, id="ref-to-itself"),
]


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.fixture
async def tools_engines(tiny_tools_model_dir):
    made: list[Engine] = []

    async def make(capacity: int) -> tuple[Engine, ModelSpec]:
        engine = Engine(EngineConfig(backend="mlx"))
        made.append(engine)
        spec = ModelSpec(1, str(tiny_tools_model_dir), "f" * 64, lane=LaneSettings(capacity=capacity))
        await engine.load(spec)
        return engine, spec

    yield make
    for engine in made:
        await engine.shutdown()


@pytest.mark.parametrize("schema", UNSERVABLE)
async def test_a_schema_the_grammar_cannot_serve_is_refused_before_admission_every_time(engines, schema):
    """Issue 25 §3: compiled and walked before admission, so it is the request's 400 (named
    field), never a failed or empty generation; a refusal is remembered, never an errored
    grammar cached, and the model serves the next request."""
    engine, spec = await engines(1)
    bad = replace(chat(spec, "bad", [("user", "x")], max_tokens=20), json_format=json.dumps(schema))
    for attempt in range(2):
        with pytest.raises(InvalidRequestError) as refused:
            await engine.submit(replace(bad, request_id=f"bad{attempt}", format_param="text.format"))
        assert refused.value.param == "text.format"
    tool = Tool("f", "", json.dumps(schema), param="tools[0].function.parameters")
    forced = replace(
        bad, request_id="tool", json_format=None, tools=(tool,), tool_choice=ToolChoice("required")
    )
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(forced)
    assert refused.value.param == "tools[0].function.parameters"
    events = await collect(await engine.submit(replace(bad, request_id="good", json_format=SCHEMA)))
    assert events[-1].finish_reason in ("stop", "length")
    if events[-1].finish_reason == "stop":
        json.loads(_text(events))


async def test_a_bad_tool_schema_beside_a_good_format_names_the_tool(engines):
    engine, spec = await engines(1)
    tools = (WEATHER, Tool("g", "", json.dumps(RECURSIVE), param="tools[1].input_schema"))
    request = replace(
        chat(spec, "r", [("user", "x")]), tools=tools, json_format=SCHEMA, format_param="output_format"
    )
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(request)
    assert refused.value.param == "tools[1].input_schema"


def _check_answer(events) -> str:
    """Valid calls of WEATHER, or JSON text that matches SCHEMA, or cut by max_tokens."""
    done = events[-1]
    assert isinstance(done, Done), done
    for call in done.tool_calls:
        arguments = json.loads(call.arguments)
        assert call.name == "get_weather" and set(arguments) == {"city", "days"}
    if done.finish_reason == "tool_calls":
        assert _text(events) == ""
        return "call"
    if done.finish_reason == "length":  # a random model may go on calling until max_tokens
        return "length"
    assert done.finish_reason == "stop" and not done.tool_calls, done
    value = json.loads(_text(events))
    assert set(value) == {"name", "tags"} and all(tag in ("a", "b") for tag in value["tags"])
    return "answer"


@pytest.mark.parametrize("native", [False, True], ids=["note", "native-markers"])
async def test_auto_tools_with_a_format_answer_a_call_or_the_typed_json(engines, tools_engines, native):
    """Issue 25 §1: with `auto`, tools and a JSON format are one grammar: every answer is one
    valid call or JSON for the schema, on a model without a tool format (marked call) and on
    one with its own markers, batched, greedy and sampled."""
    engine, spec = await (tools_engines if native else engines)(4)
    base = replace(
        chat(spec, "a", [("user", "weather in Paris, or describe it")], max_tokens=160),
        tools=(WEATHER,),
        json_format=SCHEMA,
        template_options=(("enable_thinking", False),),
    )
    requests = [
        replace(base, request_id=f"a{i}", sampling=replace(base.sampling, temperature=t, seed=i))
        for i, t in enumerate([0.0, 1.0, 1.0, 1.0, 1.5, 1.5])
    ]
    kinds = [_check_answer(events) for events in await run_together(engine, requests)]
    assert kinds.count("length") < len(kinds), kinds  # which branch a random model takes is its own


async def test_the_prompt_offers_the_tools_beside_a_format(engines, tiny_model_dir):
    """The tools are in the prompt (a note on a model without a tool format), not dropped."""
    from mlxhost.engine import prompts
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    engine, spec = await engines(1)
    model = engine.get(1).model
    request = replace(chat(spec, "p", [("user", "hi")]), tools=(WEATHER,), json_format=SCHEMA)
    rendered = prompts.render(model, request)
    text = model._tokenizer.decode(rendered.prompt_ids)
    assert "<tool_call>" in text and '"get_weather"' in text
    assert rendered.plan.mode == "choice" and rendered.plan.grammar.kind == "lark"
    del MlxBackend, tiny_model_dir


async def test_a_forced_call_then_the_typed_answer_after_its_result(engines):
    """Issue 25 §1: a forced call is the call alone; once its result is in, the same request
    (tool_choice still forced) is answered in the format."""
    engine, spec = await engines(1)
    first = replace(
        chat(spec, "f1", [("user", "weather in Paris?")], max_tokens=120),
        tools=(WEATHER,),
        tool_choice=ToolChoice("required"),
        json_format=SCHEMA,
    )
    events = await collect(await engine.submit(first))
    assert events[-1].finish_reason == "tool_calls", events[-1]
    (call,) = events[-1].tool_calls
    history = (
        *first.messages,
        Message("assistant", "", tool_calls=(ToolCall(call.id, call.name, call.arguments),)),
        Message("tool", "sunny", tool_call_id=call.id, name=call.name),
    )
    events = await collect(
        await engine.submit(
            replace(
                first, request_id="f2", messages=history, sampling=replace(first.sampling, max_tokens=200)
            )
        )
    )
    assert _check_answer(events) == "answer"


async def test_top_logprobs_under_a_grammar_leave_out_masked_tokens(engines):
    """Issue 25 §2: tokens the grammar masked (-inf) are not alternatives; every value is finite."""
    import math

    engine, spec = await engines(1)
    request = replace(chat(spec, "lp", [("user", "x")], max_tokens=12, logprobs=20), json_format=SCHEMA)
    events = await collect(await engine.submit(request))
    logprobs = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
    assert logprobs
    assert all(math.isfinite(lp.logprob) and all(math.isfinite(t.logprob) for t in lp.top) for lp in logprobs)
    assert any(len(lp.top) < 20 for lp in logprobs)  # the first token ("{") has no alternative


def test_a_grammar_that_fails_while_generating_ends_in_an_error_and_leaves_the_cache(tiny_vocabulary):
    """An errored matcher would allow only EOS, ending the answer `stop` with broken JSON; the
    processor raises instead (an error finish) and evicts the grammar, which is then refused."""
    import mlx.core as mx

    from mlxhost.engine.backends.mlx.grammar import GrammarProcessor
    from mlxhost.engine.errors import GrammarFailedError
    from mlxhost.engine.types import Grammar

    vocabulary = tiny_vocabulary
    for schema in (SELF, RECURSIVE):  # fails at the first mask / at the first token
        grammar = Grammar("json", json.dumps(schema))
        forgotten: list[bool] = []
        processor = GrammarProcessor(
            vocabulary._compile(grammar), vocabulary.logits_size, partial(forgotten.append, True)
        )
        logits = mx.zeros((1, vocabulary.logits_size))
        with pytest.raises(GrammarFailedError):
            masked = processor(mx.array([1]), logits)
            first = int(mx.argmax(masked).item())
            processor(mx.array([1, first]), logits)
        assert forgotten == [True]
        with pytest.raises(InvalidRequestError):
            vocabulary.check(grammar, "response_format")
        assert (grammar.kind, grammar.source) not in vocabulary._compiled


@pytest.fixture
def tiny_vocabulary(tiny_model_dir):
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    model = MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *a: None)
    yield model.vocabulary
    model.close()
