"""Admission and warm sessions through HTTP with the real tiny MLX model: 429s, 503s, reuse, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

HELLO = [{"role": "user", "content": "hello there"}]


def chat_body(**fields) -> str:
    return json.dumps({"model": "tiny", "messages": HELLO, **fields})


async def post_chat(api_key: str, **fields):
    return await AsyncClient().post(
        "/v1/chat/completions",
        data=chat_body(**fields),
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )


async def set_lane(alias, **fields) -> None:
    """Edit the lane of the alias's model, as the admin does, and reconcile this process's engine,
    as its control listener does on the `models.changed` message."""
    from mlxhost.runtime import control, engine_if_started
    from models_app import services

    def save() -> None:
        model = alias.model
        for name, value in fields.items():
            setattr(model, name, value)
        services.model_save(model=model)

    await sync_to_async(save)()
    if (engine := engine_if_started()) is not None:
        await control.reconcile(engine, load_pinned=False)


class StreamReader:
    """Reads an SSE response in a task, as the ASGI server would; `hang_up()` cancels that task.

    Cancelling the reading task is what Django does when the client disconnects.
    """

    def __init__(self, response) -> None:
        self.frames = 0
        self._progress = asyncio.Event()
        self._task = asyncio.create_task(self._read(response))

    async def _read(self, response) -> None:
        async for chunk in response.streaming_content:
            self.frames += chunk.count(b"data: ")
            self._progress.set()

    async def wait_for(self, frames: int) -> None:
        while self.frames < frames:
            self._progress.clear()
            await asyncio.wait_for(self._progress.wait(), timeout=30)

    async def hang_up(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


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
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-2: over budget is a 429 queue_full with Retry-After; every admitted request completes."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=2)
    await post_chat(api_key, max_tokens=1)  # load first, so the burst measures admission only
    no_eos = {str(tiny_eos_id): -100}
    responses = await asyncio.gather(
        *(post_chat(api_key, max_tokens=200, logit_bias=no_eos) for _ in range(8))
    )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}
    assert statuses.count(200) >= 3
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
    while mlx_engine.snapshot()[0]["lane"]["queued"] == 0:
        await asyncio.sleep(0.005)
    await first.hang_up()  # the stop flag is set when this returns
    produced_at_cancel = mlx_engine.snapshot()[0]["tokens_generated"]
    second = await waiting
    assert second.status_code == 200
    assert second.json()["usage"]["completion_tokens"] == 3
    snap = mlx_engine.snapshot()[0]
    # The cancelled stream ran at most one more decode step before the next request began.
    assert snap["tokens_generated"] - 3 - produced_at_cancel <= 1
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
    while not mlx_engine.snapshot()[0]["lane"]["draining"]:
        await asyncio.sleep(0.005)
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
