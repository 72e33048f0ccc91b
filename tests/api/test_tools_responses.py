"""Function tools, text formats and logprobs on /v1/responses with the tiny real MLX model (API-11..13)."""

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
    assert warm.status_code == 200 and warm["X-Session-Cache"] in ("hit", "fresh")
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
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ):
        response = await alice.create(**{"input": "x", **body})
        assert response.status_code == 400, (body, response.content)
        assert response.json()["error"]["param"] == param
