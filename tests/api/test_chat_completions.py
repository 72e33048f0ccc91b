"""POST /v1/chat/completions through Django with the tiny real MLX model."""

from __future__ import annotations

import json

import pytest
from django.test import AsyncClient

from tests.api.support import bearer, post_json, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True)]

URL = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


async def post(body: dict, key: str | None, **headers):
    return await post_json(URL, body, {**bearer(key), **headers})


async def test_non_streaming_completion_has_openai_shape(tiny_alias, api_key, mlx_engine):
    response = await post({"model": "tiny", "messages": HELLO, "max_tokens": 8}, api_key)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert response["X-Session-Cache"] == "fresh"


async def test_streaming_chunks_end_with_done_and_usage(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    body = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(tiny_eos_id): -100},
    }
    response = await post(body, api_key)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    payloads = await sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_greedy_output_is_deterministic(tiny_alias, api_key, mlx_engine):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0}
    first = (await post(body, api_key)).json()["choices"][0]["message"]["content"]
    second = (await post(body, api_key)).json()["choices"][0]["message"]["content"]
    assert first == second


async def test_alias_defaults_fill_what_the_request_leaves_out(tiny_alias, api_key, mlx_engine):
    tiny_alias.max_tokens = 3
    tiny_alias.temperature = 0.0
    await tiny_alias.asave()
    body = await post({"model": "tiny", "messages": HELLO, "logit_bias": {"0": 0}}, api_key)
    usage = body.json()["usage"]
    assert usage["completion_tokens"] <= 3


async def test_max_tokens_is_clamped_by_the_alias(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    """REG-1: max_output_tokens clamps any request's output length."""
    tiny_alias.max_output_tokens = 5
    tiny_alias.max_tokens = 5
    await tiny_alias.asave()
    bias = {str(tiny_eos_id): -100}
    response = await post(
        {"model": "tiny", "messages": HELLO, "max_tokens": 500, "logit_bias": bias}, api_key
    )
    assert response.json()["usage"]["completion_tokens"] == 5


async def test_missing_key_is_401_with_envelope(tiny_alias):
    """API-5: every API call needs a key; API-4: the 401 uses OpenAI's envelope."""
    response = await post({"model": "tiny", "messages": HELLO}, None)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert set(error) == {"message", "type", "param", "code"}


async def test_wrong_key_is_401(tiny_alias, api_key):
    response = await post({"model": "tiny", "messages": HELLO}, api_key[:-2] + "xx")
    assert response.status_code == 401


async def test_x_api_key_header_is_accepted(tiny_alias, api_key, mlx_engine):
    """API-5: keys are accepted as Bearer or x-api-key."""
    client = AsyncClient()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    response = await client.post(
        URL, data=json.dumps(body), content_type="application/json", headers={"x-api-key": api_key}
    )
    assert response.status_code == 200


async def test_revoked_key_is_401(tiny_alias, api_key):
    from asgiref.sync import sync_to_async

    from models_app.catalogue import selectors, services

    key = await sync_to_async(selectors.apikey_authenticate)(raw_key=api_key)
    await sync_to_async(services.apikey_revoke)(key=key)
    assert (await post({"model": "tiny", "messages": HELLO}, api_key)).status_code == 401


async def test_unknown_model_is_404_with_envelope(api_key):
    response = await post({"model": "no-such-model", "messages": HELLO}, api_key)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]


async def test_model_value_is_never_treated_as_a_path(tiny_alias, api_key, tiny_model_dir):
    for value in (str(tiny_model_dir), "../tiny-llama", "tiny-llama"):
        response = await post({"model": value, "messages": HELLO}, api_key)
        assert response.status_code == 404, value
        assert response.json()["error"]["code"] == "model_not_found"


async def test_disabled_alias_is_404(tiny_alias, api_key):
    tiny_alias.enabled = False
    await tiny_alias.asave()
    assert (await post({"model": "tiny", "messages": HELLO}, api_key)).status_code == 404


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        pytest.param({"temperature": -0.5}, "temperature", id="negative-temperature"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"messages": []}, "messages", id="no-messages"),
        pytest.param({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", id="bad-role"),
        pytest.param({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", id="bad-content"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, "stop", id="too-many-stops"),
        pytest.param({"n": 9}, "n", id="n-above-the-max"),
        pytest.param({"stream": "yes"}, "stream", id="stream-not-bool"),
        pytest.param({"tools": [{"type": "function"}]}, "tools", id="tool-without-function"),
        pytest.param(
            {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", id="bad-tool-name"
        ),
        pytest.param({"tools": [{"type": "web_search"}]}, "tools", id="hosted-tool"),
        pytest.param({"tools": "x"}, "tools", id="tools-not-a-list"),
        pytest.param({"tool_choice": "sometimes"}, "tool_choice", id="bad-tool-choice"),
        pytest.param({"response_format": {"type": "yaml"}}, "response_format", id="bad-format"),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            id="format-without-schema",
        ),
        pytest.param({"logprobs": True, "top_logprobs": 21}, "top_logprobs", id="too-many-top-logprobs"),
        pytest.param({"top_logprobs": 2}, "top_logprobs", id="top-logprobs-without-logprobs"),
        pytest.param({"functions": [{"name": "f"}]}, "functions", id="legacy-functions"),
        pytest.param(
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            id="tool-message-without-id",
        ),
    ],
)
async def test_bad_input_is_400_with_param(tiny_alias, api_key, patch, param):
    """API-4 (OpenAI surface): bad input is a 400 in the envelope with `param`, never a 5xx."""
    body = {"model": "tiny", "messages": HELLO, **patch}
    response = await post(body, api_key)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


async def test_malformed_json_is_400(api_key):
    client = AsyncClient()
    response = await client.post(
        URL, data="{not json", content_type="application/json", headers=bearer(api_key)
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


async def test_get_is_405_in_envelope(api_key):
    response = await AsyncClient().get(URL, headers=bearer(api_key))
    assert response.status_code == 405
    assert "error" in response.json()


async def test_stop_sequence_truncates_output(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    bias = {str(tiny_eos_id): -100}
    base = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "temperature": 0, "logit_bias": bias}
    full = (await post(base, api_key)).json()["choices"][0]["message"]["content"]
    assert len(full) > 4
    stop = full[2:4]
    cut = (await post({**base, "stop": stop}, api_key)).json()["choices"][0]
    assert cut["message"]["content"] == full[: full.index(stop)]
    assert cut["finish_reason"] == "stop"


async def test_prompt_over_max_input_tokens_is_400(tiny_alias, api_key, mlx_engine):
    tiny_alias.max_input_tokens = 5
    await tiny_alias.asave()
    response = await post({"model": "tiny", "messages": HELLO}, api_key)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
