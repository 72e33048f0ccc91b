"""POST /v1/completions (OpenAI legacy text completion) through Django with the tiny real MLX model."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async

from models_app.catalogue import services
from tests.api.support import (
    ScriptedGeneration,
    StreamReader,
    bearer,
    post_chat,
    post_json,
    set_lane,
    sse_payloads,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

URL = "/v1/completions"
PROMPT = "Once upon a time"


async def post(body: dict, key: str | None):
    return await post_json(URL, body, bearer(key))


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, **fields}


@pytest.fixture
def no_eos(tiny_eos_id) -> dict[str, int]:
    return {str(tiny_eos_id): -100}


async def test_non_streaming_completion_has_openai_shape(tiny_alias, api_key, mlx_engine, no_eos):
    """API-1: a `text_completion` object with one choice and usage."""
    response = await post(completion(max_tokens=8, logit_bias=no_eos), api_key)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert (body["object"], body["model"]) == ("text_completion", "tiny")
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert (choice["index"], choice["logprobs"], choice["finish_reason"]) == (0, None, "length")
    assert isinstance(choice["text"], str) and choice["text"]
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert response["X-Session-Cache"] == "fresh"


async def test_max_tokens_defaults_to_16_and_is_clamped_by_the_alias(tiny_alias, api_key, mlx_engine, no_eos):
    """API-1: OpenAI's default of 16 tokens; REG-1: the alias's max_output_tokens still clamps."""
    body = (await post(completion(logit_bias=no_eos), api_key)).json()
    assert body["usage"]["completion_tokens"] == 16
    tiny_alias.max_output_tokens = tiny_alias.max_tokens = 5
    await sync_to_async(services.alias_save)(alias=tiny_alias)  # the service drops cached lookups
    body = (await post(completion(max_tokens=500, logit_bias=no_eos), api_key)).json()
    assert body["usage"]["completion_tokens"] == 5


async def test_streaming_chunks_carry_the_same_text_and_end_with_usage_and_done(
    tiny_alias, api_key, mlx_engine, no_eos
):
    """API-1: SSE chunks of `text_completion`, `stream_options.include_usage`, then `data: [DONE]`."""
    whole = (await post(completion(max_tokens=10, logit_bias=no_eos), api_key)).json()
    body = completion(max_tokens=10, logit_bias=no_eos, stream=True, stream_options={"include_usage": True})
    response = await post(body, api_key)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    payloads = await sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]  # greedy
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_streaming_without_include_usage_has_no_usage_field(tiny_alias, api_key, mlx_engine):
    payloads = await sse_payloads(await post(completion(max_tokens=3, stream=True), api_key))
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in c and len(c["choices"]) == 1 for c in payloads[:-1])


async def test_stop_sequence_truncates_output(tiny_alias, api_key, mlx_engine, no_eos):
    full = (await post(completion(max_tokens=20, logit_bias=no_eos), api_key)).json()["choices"][0]["text"]
    stop = full[3:5]
    cut = (await post(completion(max_tokens=20, logit_bias=no_eos, stop=stop), api_key)).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)]
    assert cut["finish_reason"] == "stop"


async def test_a_list_of_one_prompt_is_the_same_as_the_string(tiny_alias, api_key, mlx_engine):
    one = (await post(completion(max_tokens=4), api_key)).json()
    listed = (await post(completion(prompt=[PROMPT], max_tokens=4), api_key)).json()
    assert one["choices"][0]["text"] == listed["choices"][0]["text"]
    # The same prompt: the second may start from the first's cache (SES-8), nothing else differs.
    assert listed["usage"]["prompt_tokens_details"]["cached_tokens"] <= listed["usage"]["prompt_tokens"]
    drop = {"prompt_tokens_details"}
    assert {k: v for k, v in one["usage"].items() if k not in drop} == {
        k: v for k, v in listed["usage"].items() if k not in drop
    }


async def test_a_longer_prompt_reuses_the_cached_prefix_and_matches_a_cold_run(
    tiny_alias, api_key, mlx_engine
):
    """SES-8, SES-7: a prompt extending a finished one reuses its tokens; greedy output equals a cold run."""
    probe = (await post(completion(max_tokens=12), api_key)).json()["choices"][0]["text"]
    stop = probe[4:6]
    first = (await post(completion(max_tokens=12, stop=[stop]), api_key)).json()
    assert first["choices"][0]["finish_reason"] == "stop"  # a clean finish is adopted (SES-1)
    longer = PROMPT + first["choices"][0]["text"] + " and then"

    warm = await post(completion(prompt=longer, max_tokens=8), api_key)
    cold = await post(completion(prompt=longer, max_tokens=8, cache_salt="another-domain"), api_key)

    assert warm["X-Session-Cache"] == "hit"
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold["X-Session-Cache"] == "fresh"
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]


async def test_a_full_lane_is_429_queue_full(tiny_alias, api_key, mlx_engine, no_eos):
    """LANE-2: over budget on the OpenAI surface is 429 queue_full with Retry-After."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    holder = StreamReader(await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await holder.wait_for(3)
    refused = await post(completion(max_tokens=2), api_key)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert int(refused["Retry-After"]) >= 1
    await holder.hang_up()


async def test_missing_key_is_401_and_unknown_model_is_404(tiny_alias, api_key):
    """API-5, API-4: OpenAI's envelope for auth and lookup failures."""
    unauthenticated = await post(completion(), None)
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
    missing = await post(completion(model="nope"), api_key)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        pytest.param({"prompt": ["a", "b"]}, "prompt", id="two-prompts"),
        pytest.param({"prompt": [1, 2, 3]}, "prompt", id="token-ids"),
        pytest.param({"prompt": ""}, "prompt", id="empty-prompt"),
        pytest.param({"prompt": None}, "prompt", id="null-prompt"),
        pytest.param({"echo": True}, "echo", id="echo"),
        pytest.param({"suffix": "the end"}, "suffix", id="suffix"),
        pytest.param({"logprobs": 6}, "logprobs", id="logprobs-over-five"),
        pytest.param({"n": 9}, "n", id="n-above-the-max"),
        pytest.param({"best_of": 3}, "best_of", id="best-of-above-one"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"temperature": 3}, "temperature", id="temperature-above-two"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, "stop", id="too-many-stops"),
        pytest.param({"logit_bias": {"x": 1}}, "logit_bias", id="logit-bias-not-token-ids"),
        pytest.param({"stream": "yes"}, "stream", id="stream-not-bool"),
    ],
)
async def test_bad_input_is_400_with_param(tiny_alias, api_key, patch, param):
    """API-4 (OpenAI surface): bad or unsupported input is a 400 in the envelope with `param`."""
    response = await post({**completion(), **patch}, api_key)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


async def test_no_op_values_of_unsupported_options_are_accepted(tiny_alias, api_key, mlx_engine):
    body = completion(max_tokens=2, echo=False, suffix=None, logprobs=None, n=1, best_of=1)
    assert (await post(body, api_key)).status_code == 200


async def test_a_mid_stream_failure_is_an_error_payload_then_done():
    """API-4: after the first byte a failure is an error object in OpenAI's envelope, then [DONE]."""
    from api.openai.chat import ChatTurn
    from api.openai.completions import completion_sse
    from mlxhost.engine import Delta, Failed

    generation = ScriptedGeneration(Delta(text="Hi"), Failed(code="generation_failed", message="boom"))
    frames = [
        f async for f in completion_sse(ChatTurn(id="cmpl-x", model="tiny", instance_id=1), [generation])
    ]
    assert json.loads(frames[1].decode().removeprefix("data: "))["error"]["code"] == "generation_failed"
    assert frames[-1] == b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
async def test_legacy_logprobs(tiny_alias, api_key, mlx_engine, no_eos, stream):
    """API-8: `logprobs: N` gives the legacy shape: tokens, their logprobs, N alternatives each,
    and each token's offset in the text."""
    response = await post(completion(max_tokens=4, logprobs=2, logit_bias=no_eos, stream=stream), api_key)
    assert response.status_code == 200
    if stream:
        chunks = [c for c in (await sse_payloads(response))[:-1] if c["choices"]]
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        logprobs = {
            key: [v for p in parts for v in p[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        choice = response.json()["choices"][0]
        logprobs, text = choice["logprobs"], choice["text"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]).startswith(text[:1])
