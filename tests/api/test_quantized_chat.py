"""Quantized weights (issue 28, item 2) through Django on /v1/chat/completions: tiny llamas quantized by
mlx-lm at 4 and 8 bits serve batched rows, reuse the prefix cache, call tools and answer to a JSON schema."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from mlxhost.engine.worker import CallJob
from tests.api.support import bearer, post_json
from tests.api.test_tools_chat import PERSON, WEATHER, check_weather_arguments
from tests.engine.conftest import lane_of
from tests.support import eventually, register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

URL = "/v1/chat/completions"
PROMPTS = ("hi", "The baker opened his shop.", "Where does the river go?", "snow covered the roofs")


@pytest.fixture
def quantized_alias(tiny_quantized_dir):
    return register_alias(name="tiny-q", folder=tiny_quantized_dir.name, temperature=0.0, concurrency=4)


@pytest.fixture
def quantized_tools_alias(tiny_tools_quantized_dir):
    return register_alias(name="tiny-q-tools", folder=tiny_tools_quantized_dir.name, temperature=0.0)


async def chat(api_key: str, model: str = "tiny-q", **fields):
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], **fields}
    return await post_json(URL, body, bearer(api_key))


def answer(response) -> str:
    assert response.status_code == 200, response.content
    return response.json()["choices"][0]["message"]["content"]


async def test_concurrent_requests_share_decode_steps_and_keep_their_answers(
    quantized_alias, api_key, mlx_engine, batch_sizes
):
    """LANE-1 on quantized weights: four requests held until all are admitted run as one batch, and
    each gets the answer it gets alone."""
    alone = [
        answer(await chat(api_key, messages=[{"role": "user", "content": p}], max_tokens=10)) for p in PROMPTS
    ]
    instance_id = quantized_alias.model.instance_id
    hold = threading.Event()
    mlx_engine.get(instance_id)._worker.submit(CallJob(lambda: hold.wait(30), lambda _r, _e: None))
    batch_sizes.clear()
    try:
        tasks = [
            asyncio.create_task(chat(api_key, messages=[{"role": "user", "content": p}], max_tokens=10))
            for p in PROMPTS
        ]
        await eventually(lambda: lane_of(mlx_engine, instance_id)["active"] == len(PROMPTS), timeout=30)
    finally:
        hold.set()
    together = [answer(r) for r in await asyncio.gather(*tasks)]
    assert together == alone
    assert max(batch_sizes) == len(PROMPTS)


async def test_turn_two_reuses_the_cached_prefix(quantized_alias, api_key, mlx_engine):
    """SES-7/SES-8 on quantized weights: the resent conversation hits the cache (the engine's cached
    token count is in the usage) and answers as a cold recompute does."""
    probe = answer(await chat(api_key, max_tokens=8))
    stop = probe[len(probe) // 2 : len(probe) // 2 + 2]
    first = await chat(api_key, max_tokens=8, stop=[stop])
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    turn2 = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": answer(first)},
        {"role": "user", "content": "and then?"},
    ]
    warm = await chat(api_key, messages=turn2, max_tokens=12)
    cold = await chat(api_key, messages=turn2, max_tokens=12, cache_salt="another-domain")
    assert warm["X-Session-Cache"] == "hit"
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer(warm) == answer(cold)


async def test_a_forced_tool_call_matches_its_schema(
    quantized_alias, quantized_tools_alias, api_key, mlx_engine
):
    """API-6/7 on quantized weights: a named tool choice gives a valid call, through the tool-capable
    template and through the system note of a model without one."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for model in ("tiny-q-tools", "tiny-q"):
        response = await chat(
            api_key, model, tools=[WEATHER], tool_choice=choice, max_tokens=80, temperature=1.0
        )
        assert response.status_code == 200, response.content
        body = response.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls", model
        (call,) = body["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        check_weather_arguments(call["function"]["arguments"])


async def test_a_json_schema_answer_parses_and_validates(quantized_alias, api_key, mlx_engine):
    """API-7 on quantized weights: the grammar masks the quantized model's logits like any other's."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    value = json.loads(
        answer(await chat(api_key, response_format=response_format, max_tokens=80, temperature=0.9))
    )
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99
