"""Issue 25: a tool call looks as each provider's does: a chat tool-call stream opens with
`content: null`, and tool call ids carry the surface's prefix (Anthropic `toolu_`, OpenAI `call_`)."""

from __future__ import annotations

import pytest

from tests.api.support import bearer, post_json, sse_events, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTION = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
TOOL = {"name": "get_weather", "input_schema": PARAMETERS}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}


async def chat_stream(api_key: str, **fields) -> list[dict]:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 60, "stream": True, **fields}
    response = await post_json("/v1/chat/completions", body, bearer(api_key))
    assert response.status_code == 200, response.content
    return [c for c in await sse_payloads(response) if c != "[DONE]"]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
async def test_a_forced_tool_call_stream_opens_with_null_content(tiny_alias, api_key, mlx_engine, choice):
    """OpenAI opens a tool-call stream with `content: null`; a "" there is an empty text part
    to Vercel's useChat."""
    chunks = await chat_stream(api_key, tools=[FUNCTION], tool_choice=choice)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)


async def test_with_auto_the_opening_says_what_follows(tiny_alias, tiny_model_dir, api_key, mlx_engine):
    """With `auto` the model picks: null before a call (here "{" is pushed, which starts one on
    a model without a tool format), "" before text."""
    from tokenizers import Tokenizer

    brace = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("{")
    called = await chat_stream(api_key, tools=[FUNCTION], logit_bias={str(brace): 100})
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in called)
    assert called[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = await chat_stream(api_key, tools=[FUNCTION], logit_bias={str(brace): -100}, max_tokens=4)
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in text)
    assert text[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    plain = await chat_stream(api_key, max_tokens=2)
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_anthropic_tool_use_ids_start_toolu(tiny_alias, api_key, mlx_engine, stream):
    body = {"model": "tiny", "max_tokens": 60, "messages": ASK, "tools": [TOOL], "stream": stream}
    body["tool_choice"] = {"type": "tool", "name": "get_weather"}
    response = await post_json("/v1/messages", body, {"x-api-key": api_key, **ANTHROPIC})
    assert response.status_code == 200, response.content
    if stream:
        starts = [d for name, d in await sse_events(response) if name == "content_block_start"]
        (block,) = [s["content_block"] for s in starts]
    else:
        (block,) = response.json()["content"]
    assert block["type"] == "tool_use"
    assert block["id"].startswith("toolu_") and len(block["id"]) > len("toolu_")


async def test_openai_call_ids_start_call(tiny_alias, api_key, mlx_engine):
    body = {
        "model": "tiny",
        "max_tokens": 60,
        "messages": ASK,
        "tools": [FUNCTION],
        "tool_choice": "required",
    }
    response = await post_json("/v1/chat/completions", body, bearer(api_key))
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    responses = {"model": "tiny", "input": "Weather in Oslo?", "store": False, "tool_choice": "required"}
    responses["tools"] = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    item = next(i for i in (await post_json("/v1/responses", responses, bearer(api_key))).json()["output"])
    assert item["type"] == "function_call" and item["call_id"].startswith("call_")
