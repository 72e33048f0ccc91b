"""Tools, forced calls, JSON formats, reasoning and logprobs through the engine (fake backend, API-6..9)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mlxhost.engine import Delta, Done, InvalidRequestError, Message
from mlxhost.engine.backends.fake import TOOL_CALL, UNCOMPILABLE
from mlxhost.engine.structure import TOOL_GUIDANCE, TOOL_NOTE
from mlxhost.engine.types import Grammar, ReasoningDelta, Tool, ToolCall, ToolCallDelta, ToolChoice
from tests.engine.conftest import collect, request

WEATHER = Tool(
    "get_weather", "The weather.", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
)
TIME = Tool("get_time", "The time.", '{"type": "object", "properties": {}}')


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def calls_of(events) -> dict[int, tuple[str | None, str | None, str]]:
    """Per call index: (id, name, arguments) reassembled from the streamed parts."""
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            cid, name, args = calls.get(e.index, (None, None, ""))
            calls[e.index] = (cid or e.id, name or e.name, args + e.arguments)
    return calls


async def run(engine, backend, pieces, **fields):
    backend.enqueue(pieces)
    return await collect(await engine.submit(replace(request(max_tokens=64), **fields)))


async def test_a_native_call_is_parsed_out_of_the_text_and_never_shown(engine, backend):
    """API-6: a model with its own tool format gets the tools through its template; its call
    markup, split across tokens, becomes a tool call and never answer text."""
    backend.knows_tools = backend.markers = True
    pieces = [
        "Sure. ",
        "<tool",
        "_call>",
        '{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "</tool_call>",
    ]
    events = await run(engine, backend, pieces, tools=(WEATHER,))
    done = events[-1]
    assert text_of(events) == "Sure. "
    assert done.finish_reason == "tool_calls"
    (call,) = done.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert calls_of(events) == {0: (call.id, "get_weather", call.arguments)}
    _, tools, _ = backend.renders[-1]
    assert tools == [WEATHER]  # offered through the template, not a system note
    assert backend.grammars == []  # auto on a native model: its own format, unconstrained


async def test_native_markup_that_does_not_parse_stays_text_never_a_broken_call(engine, backend):
    backend.knows_tools = backend.markers = True
    events = await run(engine, backend, ["<tool_call>", "not json", "</tool_call>"], tools=(WEATHER,))
    assert text_of(events) == "not json"
    assert events[-1].finish_reason == "stop" and events[-1].tool_calls == ()


async def test_a_model_without_tools_gets_a_note_and_a_text_or_call_grammar(engine, backend):
    """API-6: no tool format in the template: the tools are described in a system note, and
    `auto` is decoded under a grammar that allows text (not starting with "{") or one call."""
    events = await run(engine, backend, ['{"name": "get_time", ', '"arguments": {}}'], tools=(WEATHER, TIME))
    messages, tools, _ = backend.renders[-1]
    assert tools == [] and messages[0].role == "system" and messages[0].content.startswith(TOOL_NOTE)
    assert '"get_weather"' in messages[0].content
    *parts, grammar = backend.grammars  # each tool's schema is checked alone first
    assert [p.kind for p in parts] == ["json", "json"]
    assert grammar.kind == "lark" and "start: TEXT | call" in grammar.source
    assert backend.history[-1][2].grammar == grammar  # the sampler carries it to the worker
    assert events[-1].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in events[-1].tool_calls] == [("get_time", "{}")]
    assert text_of(events) == ""


async def test_text_under_the_choice_grammar_streams_as_text(engine, backend):
    events = await run(engine, backend, ["It is ", "sunny."], tools=(WEATHER,))
    assert text_of(events) == "It is sunny." and events[-1].finish_reason == "stop"


async def test_a_named_function_streams_its_arguments_as_they_come(engine, backend):
    """API-7: a forced function is decoded under its parameters' schema; the output is its
    arguments, streamed piece by piece after a first part that names the call."""
    pieces = ['{"city"', ': "Os', 'lo"}']
    events = await run(
        engine, backend, pieces, tools=(WEATHER, TIME), tool_choice=ToolChoice("auto", "get_weather")
    )
    closed = {**json.loads(WEATHER.parameters), "additionalProperties": False, "x-guidance": TOOL_GUIDANCE}
    assert [json.loads(g.source) for g in backend.grammars] == [closed]
    parts = [e for e in events if isinstance(e, ToolCallDelta)]
    assert parts[0].name == "get_weather" and parts[0].id and parts[0].arguments == ""
    assert "".join(p.arguments for p in parts[1:]) == "".join(pieces)  # as they came (Deltas may merge)
    assert events[-1].tool_calls == (ToolCall(parts[0].id, "get_weather", '{"city": "Oslo"}'),)
    assert events[-1].finish_reason == "tool_calls"


def test_tool_schemas_are_closed_to_properties_they_do_not_list():
    from mlxhost.engine.structure import arguments_schema

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "items": {"type": "object", "properties": {}}},
        },
        "$defs": {"d": {"type": "object", "properties": {"e": {}}, "additionalProperties": True}},
    }
    closed = json.loads(arguments_schema(Tool("t", "", json.dumps(schema))))
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is True  # what a schema says stands


async def test_required_with_several_tools_is_one_call_object(engine, backend):
    events = await run(
        engine,
        backend,
        ['{"name": "get_time", "arguments": {}}'],
        tools=(WEATHER, TIME),
        tool_choice=ToolChoice("required"),
    )
    grammar = backend.grammars[-1]  # after each tool's schema alone
    assert json.loads(grammar.source)["anyOf"][1]["properties"]["name"] == {"const": "get_time"}
    assert [c.name for c in events[-1].tool_calls] == ["get_time"]


async def test_a_forced_call_cut_by_max_tokens_is_not_a_call(engine, backend):
    events = await run(
        engine,
        backend,
        ['{"name": "get_time", '],
        tools=(WEATHER, TIME),
        tool_choice=ToolChoice("required"),
        sampling=replace(request().sampling, max_tokens=1),
    )
    assert events[-1].finish_reason == "length" and events[-1].tool_calls == ()
    assert text_of(events) == '{"name": "get_time", '


async def test_tool_choice_none_offers_nothing(engine, backend):
    await run(engine, backend, ["ok"], tools=(WEATHER,), tool_choice=ToolChoice("none"))
    messages, tools, _ = backend.renders[-1]
    assert tools == [] and [m.role for m in messages] == ["user"] and backend.grammars == []


async def test_a_forced_function_that_is_not_offered_is_refused(engine, backend):
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(replace(request(), tools=(WEATHER,), tool_choice=ToolChoice("auto", "nope")))
    assert refused.value.param == "tool_choice"
    assert backend.history == []


async def test_json_formats_are_grammars_and_a_bad_schema_is_refused_before_the_lane(engine, backend):
    """API-7: `json_format` constrains the answer; a schema the grammar engine refuses is an
    InvalidRequestError (400) before the request takes a slot, and later requests are served."""
    await run(engine, backend, ["{}"], json_format="")
    assert backend.grammars[-1] == Grammar("json", '{"type": "object"}')
    bad = json.dumps({UNCOMPILABLE: True})
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(replace(request("bad"), json_format=bad))
    assert refused.value.param == "response_format"
    events = await run(engine, backend, ['{"a": 1}'], json_format='{"type": "object"}')
    assert text_of(events) == '{"a": 1}'


async def test_a_constrained_answer_asks_the_template_not_to_think(engine, backend):
    await run(engine, backend, ["{}"], json_format="", template_options=(("enable_thinking", True),))
    assert backend.renders[-1][2] == {"enable_thinking": True}  # an alias's explicit choice stands
    await run(engine, backend, ["{}"], json_format="")
    assert backend.renders[-1][2] == {"enable_thinking": False}


async def test_reasoning_is_split_from_the_answer(engine, backend):
    """API-9: text between thinking markers is reasoning, never answer text."""
    backend.markers = True
    events = await run(engine, backend, ["<thi", "nk>Let me ", "see.</think>", "Four."])
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "Let me see."
    assert text_of(events) == "Four."
    assert events[-1].reasoning == "Let me see." and events[-1].finish_reason == "stop"


async def test_a_tool_call_in_history_renders_for_both_kinds_of_model(engine, backend):
    history = (
        Message("user", "weather?"),
        Message("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)),
        Message("tool", "rain", tool_call_id="call_1", name="get_weather"),
    )
    await run(engine, backend, ["ok"], messages=history, tools=(WEATHER,))
    messages, _, _ = backend.renders[-1]
    assert messages[2] == Message("assistant", '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert messages[3] == Message("user", "Function get_weather returned:\nrain")
    backend.knows_tools = True
    await run(engine, backend, ["ok"], messages=history, tools=(WEATHER,))
    assert backend.renders[-1][0] == list(history)  # the template renders them itself


async def test_count_tokens_counts_the_tools_as_rendered(engine, backend):
    plain = await engine.count_tokens(request())
    with_tools = await engine.count_tokens(replace(request(), tools=(WEATHER,)))
    note = backend.renders[-1][0][0]
    assert note.role == "system" and with_tools == plain + len("<system>") + len(note.content)


async def test_logprobs_ride_with_their_tokens_through_coalescing(engine, backend):
    """API-8: one logprob per generated token, with its text and bytes, however Deltas merge."""
    events = await run(engine, backend, ["a", "é", "c"], sampling=replace(request().sampling, logprobs=2))
    logprobs = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
    assert [lp.token for lp in logprobs] == ["a", "é", "c"]
    assert logprobs[1].bytes == tuple("é".encode()) and len(logprobs[1].top) == 2
    assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == len(logprobs) == 3


async def test_too_many_top_logprobs_are_refused(engine, backend):
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(replace(request(), sampling=replace(request().sampling, logprobs=21)))
    assert refused.value.param == "top_logprobs"


@pytest.mark.parametrize("batching", [True, False])
async def test_native_calls_in_both_schedulers(make_engine, backend, batching):
    backend.knows_tools = backend.markers = True
    backend.batching = batching
    engine = make_engine()
    backend.enqueue([TOOL_CALL[0], '{"name": "get_time", "arguments": {}}', TOOL_CALL[1]])
    events = await collect(await engine.submit(replace(request(max_tokens=8), tools=(TIME,))))
    assert [c.name for c in events[-1].tool_calls] == ["get_time"]
    assert isinstance(events[-1], Done)


async def test_single_keeps_only_the_first_native_call(engine, backend):
    """parallel_tool_calls=false (or Anthropic's disable_parallel_tool_use): at most one call."""
    backend.knows_tools = backend.markers = True
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    events = await run(
        engine, backend, [call, call], tools=(TIME,), tool_choice=ToolChoice("auto", single=True)
    )
    assert [c.name for c in events[-1].tool_calls] == ["get_time"]
    events = await run(engine, backend, [call, call], tools=(TIME,))
    assert len(events[-1].tool_calls) == 2


async def test_a_stop_string_inside_forced_arguments_does_not_cut_the_call(engine, backend):
    """API-7: a forced call is all JSON, so a stop string does not end it (was: cut, no call)."""
    choice = ToolChoice("auto", "get_weather")
    sampling = replace(request().sampling, max_tokens=64, stop=("Os",))
    events = await run(
        engine, backend, ['{"city": "', "Oslo", '"}'], tools=(WEATHER,), tool_choice=choice, sampling=sampling
    )
    assert events[-1].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in events[-1].tool_calls] == [("get_weather", '{"city": "Oslo"}')]


async def test_a_template_that_refuses_a_later_system_message_gets_it_as_a_user_note(engine, backend):
    """Claude Code's mid-conversation system reminders on a template that allows system only first."""

    def strict(messages):
        if any(m.role == "system" for m in list(messages)[1:]):
            raise ValueError("System message must be at the beginning.")

    backend.before_render = strict
    history = (Message("user", "hi"), Message("system", "Remember the rules."), Message("user", "go"))
    await run(engine, backend, ["ok"], messages=history)
    assert backend.renders[-1][0][1] == Message("user", "[System note] Remember the rules.")


async def test_a_template_that_refuses_the_conversation_is_a_400(engine, backend):
    def refuse(messages):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    backend.before_render = refuse
    with pytest.raises(InvalidRequestError) as refused:
        await engine.submit(request())
    assert refused.value.param == "messages" and "must alternate" in str(refused.value)
