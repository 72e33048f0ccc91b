"""Tools with a typed result, and schemas the grammar cannot serve, on every surface (issue 25 §1, §3).

The tiny real MLX model, over HTTP: chat completions, Responses and Messages, streamed and not.
"""

from __future__ import annotations

import json

import pytest

from tests.api.support import bearer, post_json, sse_events, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SELF = {"$ref": "#"}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.", "parameters": PARAMS},
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": PARAMS}
MESSAGES_TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": PARAMS}
ASK = [{"role": "user", "content": "Weather in Oslo, as a person?"}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def chat_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def responses_format(schema):
    return {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}


def messages_format(schema):
    return {"type": "json_schema", "schema": schema}


async def chat(key, **body):
    return await post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 120, **body}, bearer(key)
    )


async def responses(key, **body):
    return await post_json(
        "/v1/responses",
        {"model": "tiny", "input": "Weather in Oslo?", "max_output_tokens": 120, **body},
        bearer(key),
    )


async def messages(key, **body):
    headers = {"x-api-key": key, **ANTHROPIC}
    return await post_json(
        "/v1/messages", {"model": "tiny", "messages": ASK, "max_tokens": 120, **body}, headers
    )


def check_person_or_cut(text: str, finished: bool) -> None:
    if finished:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_chat_tools_with_a_format_answer_a_call_or_the_typed_json(
    tiny_alias, api_key, mlx_engine, stream
):
    """Tools are no longer dropped beside `response_format`: the answer is a valid call or
    JSON for the schema (or cut by max_tokens), streamed and not."""
    response = await chat(
        api_key, tools=[CHAT_TOOL], response_format=chat_format(PERSON), stream=stream, temperature=0
    )
    assert response.status_code == 200, response.content
    if stream:
        chunks = [c for c in await sse_payloads(response) if isinstance(c, dict) and c.get("choices")]
        finish = next(
            c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"][0]["finish_reason"]
        )
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        arguments = "".join(
            call["function"].get("arguments") or ""
            for c in chunks
            for call in c["choices"][0]["delta"].get("tool_calls") or []
        )
    else:
        body = response.json()
        (choice,) = body["choices"]
        finish, text = choice["finish_reason"], choice["message"]["content"] or ""
        without = (await chat(api_key, response_format=chat_format(PERSON), max_tokens=1)).json()
        assert body["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]  # offered, not dropped
        arguments = "".join(c["function"]["arguments"] for c in choice["message"].get("tool_calls") or [])
    if finish == "tool_calls":
        assert set(json.loads(arguments)) == {"city"} and text == ""
    else:
        assert finish in ("stop", "length")
        check_person_or_cut(text, finish == "stop")


async def test_chat_a_forced_call_with_a_format_is_a_call_then_the_typed_answer(
    tiny_alias, api_key, mlx_engine
):
    """Was a 400 ("cannot be combined with a required tool call")."""
    fields = {"tools": [CHAT_TOOL], "tool_choice": "required", "response_format": chat_format(PERSON)}
    first = await chat(api_key, **fields)
    assert first.status_code == 200, first.content
    message = first.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    history = [*ASK, message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    second = await chat(api_key, messages=history, max_tokens=200, **fields)
    assert second.status_code == 200, second.content
    (choice,) = second.json()["choices"]
    assert choice["finish_reason"] in ("stop", "length") and not choice["message"].get("tool_calls")
    check_person_or_cut(choice["message"]["content"], choice["finish_reason"] == "stop")


async def test_responses_and_messages_take_tools_with_a_format(tiny_alias, api_key, mlx_engine):
    body = (await responses(api_key, tools=[RESPONSES_TOOL], text=responses_format(PERSON))).json()
    assert body["status"] in ("completed", "incomplete"), body
    kinds = {item["type"] for item in body["output"]}
    assert kinds <= {"message", "function_call"}
    forced = await responses(
        api_key, tools=[RESPONSES_TOOL], tool_choice="required", text=responses_format(PERSON), stream=True
    )
    assert forced.status_code == 200, forced.content
    events = [e for e in await sse_payloads(forced) if isinstance(e, dict)]
    (done,) = [e for e in events if e.get("type") == "response.completed"]
    assert [item["type"] for item in done["response"]["output"]] == ["function_call"]
    response = await messages(api_key, tools=[MESSAGES_TOOL], output_format=messages_format(PERSON))
    assert response.status_code == 200, response.content
    assert response.json()["stop_reason"] in ("tool_use", "end_turn", "max_tokens")
    forced = await messages(
        api_key,
        tools=[MESSAGES_TOOL],
        tool_choice={"type": "any"},
        output_config={"format": messages_format(PERSON)},
        stream=True,
    )
    assert forced.status_code == 200, forced.content
    deltas = [data for _, data in await sse_events(forced) if data.get("type") == "message_delta"]
    assert deltas[-1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("schema", [pytest.param(RECURSIVE, id="recursive"), pytest.param(SELF, id="self")])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_schema_the_grammar_cannot_serve_is_a_400_naming_the_field_on_every_surface(
    tiny_alias, api_key, mlx_engine, schema, stream
):
    """Issue 25 §3: 400 in the surface's envelope before any work (was 500 generation_failed,
    200 `status: failed` on Responses, or an empty answer), naming the field, every time."""
    cases = [
        (chat, {"response_format": chat_format(schema)}, "response_format"),
        (
            chat,
            {
                "tools": [{**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "parameters": schema}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (responses, {"text": responses_format(schema)}, "text.format"),
        (
            responses,
            {"tools": [{**RESPONSES_TOOL, "parameters": schema}], "tool_choice": "required"},
            "tools[0].parameters",
        ),
    ]
    for post, body, param in cases:
        for _ in range(2):  # a refusal stays a refusal
            response = await post(api_key, stream=stream, **body)
            assert response.status_code == 400, (param, response.content)
            error = response.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_value", error
    anthropic = [
        ({"output_format": messages_format(schema)}, "output_format"),
        ({"output_config": {"format": messages_format(schema)}}, "output_config.format"),
        (
            {
                "tools": [MESSAGES_TOOL, {**MESSAGES_TOOL, "name": "other", "input_schema": schema}],
                "tool_choice": {"type": "any"},
            },
            "tools[1].input_schema",
        ),
    ]
    for body, param in anthropic:
        response = await messages(api_key, stream=stream, **body)
        assert response.status_code == 400, (param, response.content)
        payload = response.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["message"].startswith(f"{param}:"), payload


async def test_logprobs_under_a_format_are_finite_json(tiny_alias, api_key, mlx_engine):
    """Issue 25 §2 (engine side): masked tokens are left out of top_logprobs, so the body has
    no -Infinity and parses as strict JSON."""
    response = await chat(
        api_key, response_format=chat_format(PERSON), logprobs=True, top_logprobs=20, max_tokens=10
    )
    assert response.status_code == 200, response.content
    body = json.loads(response.content, parse_constant=lambda name: pytest.fail(f"{name} in the body"))
    tokens = body["choices"][0]["logprobs"]["content"]
    assert tokens and any(len(t["top_logprobs"]) < 20 for t in tokens)


async def test_a_schema_the_grammar_cannot_serve_is_a_400_error_frame_on_the_websocket(
    tiny_alias, api_key, mlx_engine
):
    from tests.api.support import connect, frames_until, key_headers, ws_create

    socket = await connect(key_headers(api_key))
    try:
        await ws_create(socket, input="x", text=responses_format(RECURSIVE))
        (frame,) = await frames_until(socket, "error", "response.failed", "response.completed")
        assert frame["type"] == "error" and frame["status"] == 400, frame
        assert frame["error"]["param"] == "text.format"
        await ws_create(socket, input="x", max_output_tokens=2)  # the socket goes on
        assert (await frames_until(socket, "response.completed", "response.incomplete", "error"))[-1][
            "type"
        ] != "error"
    finally:
        await socket.disconnect()
