"""Function tools, text formats and logprobs on /v1/responses with the tiny real MLX model (API-6..8)."""

from __future__ import annotations

import json

import pytest

from tests.api.test_responses import URL, Caller

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture
def alice(api_key, user) -> Caller:
    return Caller(api_key, user.pk)


def sse(response) -> list[dict]:
    return response


async def events_of(response) -> list[dict]:
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


async def test_a_forced_function_call_is_an_output_item_with_valid_arguments(tiny_alias, alice, mlx_engine):
    body = await alice.ok(input="weather in Oslo?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=60)
    assert body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert set(json.loads(item["arguments"])) == {"city"}
    assert body["tools"] == [WEATHER] and body["tool_choice"] == FORCED
    stored = (await alice.call("get", f"{URL}/{body['id']}")).json()
    assert stored["output"] == body["output"]


async def test_streamed_function_call_events(tiny_alias, alice, mlx_engine):
    """The function-call item's added, arguments delta and done events, and its item done."""
    response = await alice.create(
        input="weather?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=60, stream=True
    )
    events = await events_of(response)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["status"] == "in_progress"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" not in kinds
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = events[-3]
    assert done["arguments"] == deltas and done["name"] == "get_weather"
    assert events[-2]["item"]["arguments"] == deltas
    assert events[-1]["response"]["output"] == [events[-2]["item"]]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_tool_chain_continues_warm_and_replays_cold(tiny_alias, alice, mlx_engine):
    """A call, its function_call_output, an answer, then a stored continuation: warm, and after
    eviction the same turn replays cold with the same text (the call is part of the chain)."""
    call = await alice.ok(input="weather in Oslo?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=60)
    (item,) = call["output"]
    result = {"type": "function_call_output", "call_id": item["call_id"], "output": "4 degrees, rain"}
    answer = await alice.ok(
        input=[result], previous_response_id=call["id"], tools=[WEATHER], max_output_tokens=6
    )
    assert answer["status"] in ("completed", "incomplete")
    items = (await alice.call("get", f"{URL}/{answer['id']}/input_items")).json()["data"]
    assert items[0]["type"] == "function_call_output" and items[0]["call_id"] == item["call_id"]

    warm = await alice.create(input="thanks", previous_response_id=answer["id"], max_output_tokens=6)
    # Without `tools` the prompt's start differs from the parent's: reused only in part (SES-7).
    assert warm.status_code == 200 and warm["X-Session-Cache"] in ("hit", "partial")
    for instance in mlx_engine.registry.instances():
        instance.sessions.clear()
    cold = await alice.create(input="thanks", previous_response_id=answer["id"], max_output_tokens=6)
    assert cold["X-Session-Cache"] == "cold_replay"
    assert cold.json()["output"] == [
        {**o, "id": o["id"].replace(warm.json()["id"][5:], cold.json()["id"][5:])}
        for o in warm.json()["output"]
    ]


async def test_function_call_items_in_the_input_render_as_the_assistants_call(tiny_alias, alice, mlx_engine):
    body = await alice.ok(
        input=[
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert body["usage"]["input_tokens"] > 40


async def test_text_format_json_schema(tiny_alias, alice, mlx_engine):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}}
    body = await alice.ok(input="ok?", text=text, max_output_tokens=40)
    assert json.loads(body["output"][0]["content"][0]["text"]).keys() == {"ok"}
    assert body["text"] == text


async def test_logprobs_when_included(tiny_alias, alice, mlx_engine, tiny_eos_id):
    body = await alice.ok(
        input="hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=4,
        logit_bias={str(tiny_eos_id): -100},
    )
    part = body["output"][0]["content"][0]
    assert len(part["logprobs"]) == 4 and all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    assert (
        b"".join(bytes(e["bytes"]) for e in part["logprobs"])
        .decode("utf-8", "replace")
        .startswith(part["text"][:1])
    )


async def test_hosted_tools_and_bad_tool_choices_are_400s(tiny_alias, alice, mlx_engine):
    for body, param in (
        ({"tools": [{"type": "custom", "name": "freeform"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ):
        response = await alice.create(**{"input": "x", **body})
        assert response.status_code == 400, (body, response.content)
        assert response.json()["error"]["param"] == param


async def test_the_websocket_sends_the_same_function_call_events(tiny_alias, api_key, mlx_engine):
    """API-3, API-6: a forced call over the socket gives the Responses tool events."""
    from tests.api.support import WS_TERMINAL, connect, frames_until, key_headers, ws_create

    socket = await connect(key_headers(api_key))
    try:
        await ws_create(socket, input="weather?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=60)
        frames = await frames_until(socket, *WS_TERMINAL)
    finally:
        await socket.disconnect()
    kinds = [f["type"] for f in frames]
    assert "response.function_call_arguments.delta" in kinds and frames[-1]["type"] == "response.completed"
    (item,) = frames[-1]["response"]["output"]
    assert item["type"] == "function_call"
    deltas = "".join(f["delta"] for f in frames if f["type"] == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(item["arguments"])


@pytest.fixture
def thinking_alias(tiny_tools_model_dir):
    from tests.support import register_alias

    return register_alias(name="thinker", folder="tiny-llama-tools", temperature=0.0, enable_thinking=True)


async def test_reasoning_is_an_item_apart_from_the_message(thinking_alias, alice, mlx_engine):
    """API-9: the alias turns thinking on; what the model writes inside the thinking block the
    template opened is a reasoning item, never message text (the random model never closes it)."""
    body = await alice.ok(model="thinker", input="hi", max_output_tokens=6)
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"]
    assert body["output"][1]["content"][0]["text"] == ""
    response = await alice.create(model="thinker", input="hi", max_output_tokens=6, stream=True)
    events = await events_of(response)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == body["output"][0]["content"][0]["text"]


async def test_reasoning_content_on_chat_and_thinking_blocks_on_messages(thinking_alias, api_key, mlx_engine):
    from tests.api.support import bearer, post_json

    chat = await post_json(
        "/v1/chat/completions",
        {"model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
        bearer(api_key),
    )
    message = chat.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""
    anthropic_headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    body = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    plain = await post_json("/v1/messages", body, anthropic_headers)
    assert [b["type"] for b in plain.json()["content"]] == ["text"]  # thinking not asked for: left out
    asked = await post_json("/v1/messages", {**body, "thinking": {"type": "adaptive"}}, anthropic_headers)
    blocks = asked.json()["content"]
    assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"]


async def test_a_request_that_disables_thinking_overrides_the_alias(thinking_alias, api_key, mlx_engine):
    """API-9: Anthropic `thinking: disabled` switches the template's thinking off for that request."""
    from tests.api.support import post_json

    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    body = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    off = await post_json("/v1/messages", {**body, "thinking": {"type": "disabled"}}, headers)
    on = await post_json("/v1/messages", body, headers)
    assert off.json()["content"][0]["text"]  # the answer, not a reasoning nobody asked to see
    assert on.json()["content"] == [{"type": "text", "text": ""}]  # the alias thinks: reasoning left out
    prompt = [
        r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] for r in (off, on)
    ]
    assert prompt[0] < prompt[1]  # no thinking block opened by the template


async def test_an_item_reference_to_a_stored_function_call(tiny_alias, alice, mlx_engine):
    """What the Vercel AI SDK sends on turn 2 with tools: the earlier call by its item id, then the result."""
    call = await alice.ok(input="weather?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=60)
    (item,) = call["output"]
    body = await alice.ok(
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "item_reference", "id": item["id"]},
            {"type": "function_call_output", "call_id": item["call_id"], "output": "rain"},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    items = (await alice.call("get", f"{URL}/{body['id']}/input_items?order=asc")).json()["data"]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1]["call_id"] == item["call_id"] and items[1]["arguments"] == item["arguments"]
    missing = await alice.create(input=[{"type": "item_reference", "id": item["id"][:-1] + "9"}])
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input[0]"
