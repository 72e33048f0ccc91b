"""Tools with a typed (JSON) answer on one request, through the engine (fake backend, issue 25 §1)."""

from __future__ import annotations

import json

import pytest

from mlxhost.engine import InvalidRequestError, Message
from mlxhost.engine.backends.fake import UNCOMPILABLE
from mlxhost.engine.structure import CALL_MARK, MARKED_TOOL_NOTE, arguments_schema
from mlxhost.engine.types import Grammar, Tool, ToolCall, ToolChoice
from tests.engine.test_answers import TIME, WEATHER, calls_of, run, text_of

ANSWER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


async def test_auto_tools_and_a_format_offer_the_tools_and_allow_a_marked_call(engine, backend):
    """Without a tool format the note asks for a marked call; one grammar allows that call or
    the JSON answer; the call is read as a call (never as the answer)."""
    pieces = [CALL_MARK, '{"name": "get_time", ', '"arguments": {}}']
    events = await run(engine, backend, pieces, tools=(WEATHER, TIME), json_format=ANSWER)
    messages, tools, _ = backend.renders[-1]
    assert tools == [] and messages[0].role == "system" and messages[0].content.startswith(MARKED_TOOL_NOTE)
    grammar = backend.history[-1][2].grammar
    assert grammar.kind == "lark" and grammar.source.startswith("start: call | answer")
    assert json.dumps(CALL_MARK) in grammar.source and '"required": ["city"]' in grammar.source
    assert events[-1].finish_reason == "tool_calls" and text_of(events) == ""
    assert [(c.name, c.arguments) for c in events[-1].tool_calls] == [("get_time", "{}")]


async def test_the_typed_answer_under_the_same_grammar_streams_as_text(engine, backend):
    events = await run(engine, backend, ['{"city": ', '"Oslo"}'], tools=(WEATHER,), json_format=ANSWER)
    assert text_of(events) == '{"city": "Oslo"}' and events[-1].finish_reason == "stop"
    assert events[-1].tool_calls == ()


async def test_a_native_model_keeps_its_markers_beside_a_format(engine, backend):
    backend.knows_tools = backend.markers = True
    pieces = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', "</tool_call>"]
    events = await run(engine, backend, pieces, tools=(WEATHER,), json_format=ANSWER)
    _, tools, _ = backend.renders[-1]
    assert tools == [WEATHER]  # through the template
    grammar = backend.history[-1][2].grammar
    assert grammar.source.startswith("start: calls | answer") and '"<tool_call>"' in grammar.source
    assert events[-1].finish_reason == "tool_calls"
    assert calls_of(events)[0][1:] == ("get_weather", '{"city": "Oslo"}')


@pytest.mark.parametrize(
    "choice", [ToolChoice("required"), ToolChoice("required", "get_weather")], ids=["required", "named"]
)
async def test_a_forced_call_with_a_format_is_the_call_then_the_answer_after_its_result(
    engine, backend, choice
):
    """A forced call is constrained alone (no 400); the turn after its result answers in the
    format, with the tools still in the prompt (the same prefix as the turn before)."""
    fields = {"tools": (WEATHER,), "tool_choice": choice, "json_format": ANSWER}
    events = await run(engine, backend, ['{"city": "Oslo"}'], **fields)
    assert events[-1].finish_reason == "tool_calls"
    first_prompt = backend.renders[-1][0]
    assert backend.history[-1][2].grammar == Grammar("json", arguments_schema(WEATHER))  # the call's args
    (call,) = events[-1].tool_calls
    history = (
        Message("user", "hi"),
        Message("assistant", "", tool_calls=(ToolCall(call.id, call.name, call.arguments),)),
        Message("tool", "sunny", tool_call_id=call.id, name=call.name),
    )
    events = await run(engine, backend, ['{"city": "Oslo"}'], messages=history, **fields)
    assert backend.history[-1][2].grammar == Grammar("json", ANSWER)
    assert text_of(events) == '{"city": "Oslo"}' and events[-1].finish_reason == "stop"
    messages = backend.renders[-1][0]
    assert messages[0] == first_prompt[0]  # the same note: the cached prefix holds
    assert messages[2].content == CALL_MARK + json.dumps(
        {"name": "get_weather", "arguments": {"city": "Oslo"}}
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"json_format": json.dumps({UNCOMPILABLE: 1})}, "output_config.format", id="format"),
        pytest.param(
            {
                "tools": (
                    WEATHER,
                    Tool("bad", "", json.dumps({UNCOMPILABLE: 1}), param="tools[1].input_schema"),
                )
            },
            "tools[1].input_schema",
            id="tool",
        ),
    ],
)
async def test_the_part_that_cannot_be_served_is_named(engine, backend, fields, param):
    fields = {"tools": (WEATHER,), "json_format": ANSWER, **fields}
    with pytest.raises(InvalidRequestError) as refused:
        await run(engine, backend, ["{}"], format_param="output_config.format", **fields)
    assert refused.value.param == param
    assert backend.history == []  # refused before the lane
