"""Tool use, structured output and thinking on /v1/messages with the tiny real MLX model (API-6..9)."""

from __future__ import annotations

import json

import pytest

from tests.api.support import post_json, sse_events

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def headers(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


async def post(key: str, path: str = "/v1/messages", **body):
    return await post_json(path, {"model": "tiny", "max_tokens": 60, "messages": ASK, **body}, headers(key))


async def test_a_forced_tool_gives_a_tool_use_block_with_valid_input(tiny_alias, api_key, mlx_engine):
    response = await post(api_key, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["stop_reason"] == "tool_use"
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert set(block["input"]) == {"city"} and isinstance(block["input"]["city"], str)


async def test_streamed_tool_use_reassembles_from_input_json_deltas(tiny_alias, api_key, mlx_engine):
    response = await post(api_key, tools=[WEATHER], tool_choice={"type": "any"}, stream=True)
    events = await sse_events(response)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    starts = [data for name, data in events if name == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    partial = "".join(data["delta"]["partial_json"] for name, data in events if name == "content_block_delta")
    assert all(
        data["delta"]["type"] == "input_json_delta" for name, data in events if name == "content_block_delta"
    )
    assert set(json.loads(partial)) == {"city"}
    (delta,) = [data for name, data in events if name == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_a_tool_result_continuation_answers(tiny_alias, api_key, mlx_engine):
    call = (await post(api_key, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})).json()
    (block,) = call["content"]
    history = [
        *ASK,
        {"role": "assistant", "content": call["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "4 degrees"}],
        },
    ]
    response = await post(api_key, messages=history, tools=[WEATHER], max_tokens=6)
    assert response.status_code == 200, response.content
    assert response.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    counted = await post(api_key, "/v1/messages/count_tokens", messages=history, tools=[WEATHER])
    plain = await post(api_key, "/v1/messages/count_tokens", messages=history)
    assert counted.json()["input_tokens"] > plain.json()["input_tokens"]  # count_tokens counts the tools
    usage = response.json()["usage"]  # input_tokens leaves out what the prefix cache held
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted.json()["input_tokens"]


@pytest.mark.parametrize("field", ["output_format", "output_config"])
async def test_structured_output(tiny_alias, api_key, mlx_engine, field):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "schema": schema}
    body = {field: fmt if field == "output_format" else {"format": fmt}}
    response = await post(api_key, **body)
    assert response.status_code == 200, response.content
    assert json.loads(response.json()["content"][0]["text"]).keys() == {"ok"}


async def test_bad_tools_are_400s_naming_the_field(tiny_alias, api_key, mlx_engine):
    for body, param in (
        ({"tools": [{"type": "mystery_tool", "name": "m"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"output_format": {"type": "json_schema"}}, "output_format"),
    ):
        response = await post(api_key, **body)
        assert response.status_code == 400, (body, response.content)
        assert response.json()["type"] == "error"
        assert param in response.json()["error"]["message"]


async def test_anthropic_defined_tools_are_left_out_and_named(tiny_alias, api_key, mlx_engine):
    """Issue 17: Anthropic-defined tools (web search, bash, text editor) have no schema here: left
    out of the prompt, named in X-Tools-Ignored, and the request is served."""
    tools = [{"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"}]
    response = await post(api_key, tools=[WEATHER, *tools], max_tokens=4)
    assert response.status_code == 200, response.content
    assert response["X-Tools-Ignored"] == "web_search_20250305, bash_20250124"
