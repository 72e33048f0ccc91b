"""Admission and warm sessions through HTTP with the real tiny MLX model: 429s, 503s, reuse, cancel."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.test import AsyncClient

from tests.api.support import HELLO, StreamReader, post_chat, set_lane
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


async def test_turn_two_reuses_the_cached_prefix_and_matches_a_cold_recompute(
    tiny_alias, api_key, mlx_engine
):
    """SES-8, SES-7: a resent conversation reuses the cached prefix; greedy output equals a cold run."""
    probe = (await post_chat(api_key, max_tokens=8)).json()
    text = probe["choices"][0]["message"]["content"]
    # A stop string ends turn 1 cleanly ("stop"), so its cache is adopted (SES-1).
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    first = await post_chat(api_key, max_tokens=8, stop=[stop])
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    reply = first.json()["choices"][0]["message"]["content"]
    turn2 = [*HELLO, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]

    warm = await post_chat(api_key, messages=turn2, max_tokens=12)
    cold = await post_chat(api_key, messages=turn2, max_tokens=12, cache_salt="another-domain")

    assert warm["X-Session-Cache"] == "hit"
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold["X-Session-Cache"] == "fresh"
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]


async def test_a_burst_beyond_capacity_and_depth_gets_429s_and_the_admitted_complete(
    tiny_alias, api_key, mlx_engine, tiny_eos_id, monkeypatch
):
    """LANE-2: over budget is a 429 queue_full with Retry-After; every admitted request completes.
    The worker is held until the burst has been answered, so exactly capacity + depth = 3 are
    admitted and the other 5 refused, however fast the machine decodes."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=2)
    await post_chat(api_key, max_tokens=1)  # load first, so the burst measures admission only
    (instance,) = mlx_engine.registry.instances()
    release, generate = threading.Event(), instance.model.generate

    def held(*args, **kwargs):  # on the worker thread: nothing finishes until the test says so
        release.wait(30)
        return generate(*args, **kwargs)

    monkeypatch.setattr(instance.model, "generate", held)
    no_eos = {str(tiny_eos_id): -100}
    burst = [asyncio.create_task(post_chat(api_key, max_tokens=200, logit_bias=no_eos)) for _ in range(8)]
    try:
        await eventually(lambda: sum(t.done() for t in burst) == 5, timeout=30, what="the five refusals")
        lane = mlx_engine.snapshot()[0]["lane"]
        assert (lane["active"], lane["queued"]) == (1, 2)
    finally:
        release.set()
    responses = await asyncio.gather(*burst)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 3 + [429] * 5
    for response in responses:
        if response.status_code == 429:
            assert int(response["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == 200


async def test_a_disconnect_frees_the_slot_for_the_next_request_within_a_decode_step(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-6: closing the stream stops the worker; the queued request gets the slot next."""
    no_eos = {str(tiny_eos_id): -100}
    first = StreamReader(await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await first.wait_for(10)
    waiting = asyncio.create_task(post_chat(api_key, max_tokens=3, logit_bias=no_eos))
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["queued"], what="the second request to queue")
    await first.hang_up()  # the stop flag is set when this returns
    produced_at_cancel = mlx_engine.snapshot()[0]["tokens_generated"]
    second = await waiting
    assert second.status_code == 200
    assert second.json()["usage"]["completion_tokens"] == 3
    snap = mlx_engine.snapshot()[0]
    # The cancelled stream ran at most one more decode step before the next request began: mlx-lm
    # computes each next token ahead (mx.async_eval), so the worker may still count the token that
    # was in flight when it saw the stop, and the one it had scheduled after it (2 in about one run
    # in ten on 2 busy cores; 1 usually). Anything more would mean the cancel did not stop it.
    assert snap["tokens_generated"] - 3 - produced_at_cancel <= 2
    assert snap["requests_cancelled"] == 1
    readyz = await AsyncClient().get("/readyz", headers={"Authorization": f"Bearer {api_key}"})
    assert readyz.json()["instances"][0]["lane"]["active"] == 0


async def test_a_draining_model_answers_503_with_retry_after(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    """LANE-7: while an instance drains, new requests are refused at once with 503 + Retry-After."""
    no_eos = {str(tiny_eos_id): -100}
    running = StreamReader(await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await running.wait_for(2)
    instance_id = mlx_engine.snapshot()[0]["instance_id"]
    drain = asyncio.create_task(mlx_engine.drain(instance_id, "wait", timeout=30))
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["draining"], what="the lane to drain")
    refused = await post_chat(api_key, max_tokens=2)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    assert int(refused["Retry-After"]) >= 1
    await running.hang_up()
    await drain
    again = await post_chat(api_key, max_tokens=2)  # drained, freed, and loaded again on demand
    assert again.status_code == 200


async def test_a_queue_timeout_answers_503_and_leaves_the_running_request_alone(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-8: a waiter past the queue timeout gets 503 queue_timeout; the slot holder finishes."""
    await set_lane(tiny_alias, queue_timeout_s=0.2)
    no_eos = {str(tiny_eos_id): -100}
    running = StreamReader(await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await running.wait_for(2)
    waited = await post_chat(api_key, max_tokens=2)
    assert waited.status_code == 503
    assert waited.json()["error"]["code"] == "queue_timeout"
    assert mlx_engine.snapshot()[0]["lane"]["active"] == 1
    await running.hang_up()
