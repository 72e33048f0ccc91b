"""Tools, JSON formats and logprobs on /v1/chat/completions with the tiny real MLX model (API-6..10)."""

from __future__ import annotations

import json

import pytest

from tests.api.support import bearer, post_json, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True)]

URL = "/v1/chat/completions"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
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


async def post(api_key: str, **fields):
    return await post_json(
        URL, {"model": "tiny", "messages": ASK, "max_tokens": 80, **fields}, bearer(api_key)
    )


def check_weather_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and value["unit"] in ("celsius", "fahrenheit")
    assert isinstance(value["city"], str) and len(value["city"]) <= 16


async def test_a_named_tool_choice_returns_a_call_that_matches_the_schema(tiny_alias, api_key, mlx_engine):
    """API-7: a forced function on a model without tool support still gets a valid call."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = await post(api_key, tools=[WEATHER], tool_choice=choice, temperature=1.0)
    assert response.status_code == 200, response.content
    (body,) = [response.json()["choices"][0]]
    assert body["finish_reason"] == "tool_calls"
    message = body["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    check_weather_arguments(call["function"]["arguments"])


async def test_streamed_tool_call_deltas_reassemble_to_the_call(tiny_alias, api_key, mlx_engine):
    response = await post(api_key, tools=[WEATHER], tool_choice="required", stream=True)
    assert response.status_code == 200
    chunks = [c for c in (await sse_payloads(response))[:-1] if c["choices"]]
    parts = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert all(p["index"] == 0 and "id" not in p for p in parts[1:])
    check_weather_arguments("".join(p["function"]["arguments"] for p in parts))
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_answer_parses_and_validates(tiny_alias, api_key, mlx_engine, stream):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    response = await post(api_key, response_format=response_format, stream=stream, temperature=0.9)
    assert response.status_code == 200
    if stream:
        chunks = (await sse_payloads(response))[:-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    else:
        text = response.json()["choices"][0]["message"]["content"]
    value = json.loads(text)
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99


async def test_json_object_answers_an_object(tiny_alias, api_key, mlx_engine):
    response = await post(api_key, response_format={"type": "json_object"}, max_tokens=200)
    text = response.json()["choices"][0]["message"]["content"]
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(text), dict)


async def test_a_schema_the_grammar_engine_refuses_is_a_400_naming_it(tiny_alias, api_key, mlx_engine):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    response = await post(
        api_key, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "response_format" and "schema" in error["message"]
    ok = await post(api_key, max_tokens=4)
    assert ok.status_code == 200  # nothing broke for the next request


async def test_schema_bounds_are_400s(tiny_alias, api_key, mlx_engine):
    deep: dict = {"type": "object"}
    for _ in range(30):
        deep = {"type": "object", "properties": {"x": deep}}
    response = await post(
        api_key, response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]
    response = await post(api_key, tools=many)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_with_top_alternatives(tiny_alias, api_key, mlx_engine, stream, tiny_eos_id):
    """API-8: one entry per token, with exact bytes and `top_logprobs` alternatives, best first."""
    response = await post(
        api_key,
        logprobs=True,
        top_logprobs=3,
        max_tokens=5,
        stream=stream,
        logit_bias={str(tiny_eos_id): -100},
    )
    if stream:
        chunks = [c for c in (await sse_payloads(response))[:-1] if c["choices"]]
        entries = [
            e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
        ]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        choice = response.json()["choices"][0]
        entries, text = choice["logprobs"]["content"], choice["message"]["content"]
    assert len(entries) == 5
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    for entry in entries:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]


async def test_a_tool_result_continues_the_conversation(tiny_alias, api_key, mlx_engine):
    """A call and its result in the history render and the model answers (role "tool")."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees and rain"},
    ]
    response = await post(api_key, messages=history, tools=[WEATHER], max_tokens=6)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert body["usage"]["prompt_tokens"] > 60  # the tool note, the call and the result were rendered


async def test_auto_on_a_model_without_tools_is_text_or_a_valid_call(tiny_alias, api_key, mlx_engine):
    """docs/api.md's design: auto on a model without tool support answers text (never starting with
    "{") or one valid call, whatever it samples."""
    for seed in range(4):
        response = await post(api_key, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=120)
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            check_weather_arguments(choice["message"]["tool_calls"][0]["function"]["arguments"])
        else:
            assert not (choice["message"]["content"] or "").startswith("{")
