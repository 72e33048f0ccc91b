"""Usage per API key and per user, and per-key limits, through every surface with the tiny real
MLX model (KEY-1, KEY-2, KEY-4)."""

from __future__ import annotations

import time

import pytest
from asgiref.sync import sync_to_async
from django.db.models import Sum
from django.test import AsyncClient

from models_app.accounting import limits, usage
from models_app.catalogue import services
from models_app.models import ApiKey, UsageDay
from tests.api.support import (
    WS_HOST,
    StreamReader,
    connect,
    frames_until,
    key_headers,
    post_json,
    sse_events,
    sse_payloads,
    ws_create,
)
from tests.support import eventually, user_with_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

HELLO = [{"role": "user", "content": "Say hello to the tiny model"}]
COUNTS = ("prompt_tokens", "cached_tokens", "output_tokens")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def anthropic(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


def openai_usage(body: dict) -> tuple[int, int, int]:
    details = body.get("prompt_tokens_details") or {}
    return body["prompt_tokens"], details.get("cached_tokens", 0), body["completion_tokens"]


def responses_usage(body: dict) -> tuple[int, int, int]:
    return body["input_tokens"], body["input_tokens_details"]["cached_tokens"], body["output_tokens"]


def messages_usage(body: dict) -> tuple[int, int, int]:
    cached = body["cache_read_input_tokens"]
    return body["input_tokens"] + cached, cached, body["output_tokens"]


# One turn per surface and mode; each returns the usage its answer reported.


async def chat(key: str) -> tuple[int, int, int]:
    response = await post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 4}, bearer(key)
    )
    assert response.status_code == 200, response.content
    return openai_usage(response.json()["usage"])


async def chat_stream(key: str) -> tuple[int, int, int]:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "stream": True}
    response = await post_json(
        "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}, bearer(key)
    )
    assert response.status_code == 200
    payloads = await sse_payloads(response)
    return openai_usage(payloads[-2]["usage"])


async def completion(key: str) -> tuple[int, int, int]:
    response = await post_json(
        "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 3}, bearer(key)
    )
    assert response.status_code == 200, response.content
    return openai_usage(response.json()["usage"])


async def responses(key: str) -> tuple[int, int, int]:
    body = {"model": "tiny", "input": "Hello there", "max_output_tokens": 4, "store": False}
    response = await post_json("/v1/responses", body, bearer(key))
    assert response.status_code == 200, response.content
    return responses_usage(response.json()["usage"])


async def responses_stream(key: str) -> tuple[int, int, int]:
    body = {"model": "tiny", "input": "Hello there", "max_output_tokens": 4, "stream": True}
    response = await post_json("/v1/responses", body, bearer(key))
    assert response.status_code == 200
    [final] = [
        p
        for p in await sse_payloads(response)
        if p != "[DONE]" and p["type"] in ("response.completed", "response.incomplete")
    ]
    return responses_usage(final["response"]["usage"])


async def messages(key: str) -> tuple[int, int, int]:
    body = {"model": "tiny", "max_tokens": 4, "messages": HELLO}
    response = await post_json("/v1/messages", body, anthropic(key))
    assert response.status_code == 200, response.content
    return messages_usage(response.json()["usage"])


async def messages_stream(key: str) -> tuple[int, int, int]:
    body = {"model": "tiny", "max_tokens": 4, "messages": HELLO, "stream": True}
    response = await post_json("/v1/messages", body, anthropic(key))
    assert response.status_code == 200
    events = await sse_events(response)
    start = next(data for name, data in events if name == "message_start")["message"]["usage"]
    final = next(data for name, data in events if name == "message_delta")["usage"]
    assert messages_usage(start)[:2] == messages_usage(final)[:2]
    return messages_usage(final)


async def websocket(key: str) -> tuple[int, int, int]:
    socket = await connect(key_headers(key))
    try:
        await ws_create(socket, input="Hello there", max_output_tokens=4, store=False)
        frames = await frames_until(
            socket, "response.completed", "response.incomplete", "response.failed", "error"
        )
        assert frames[-1]["type"] in ("response.completed", "response.incomplete"), frames[-1]
        return responses_usage(frames[-1]["response"]["usage"])
    finally:
        await socket.disconnect()


SURFACES = (chat, chat_stream, completion, responses, responses_stream, messages, messages_stream, websocket)


def rows_of(key: str) -> dict[str, int]:
    summed = UsageDay.objects.filter(key__prefix=key[:13]).aggregate(
        requests=Sum("requests"), **{name: Sum(name) for name in COUNTS}
    )
    return {name: value or 0 for name, value in summed.items()}


async def test_twenty_turns_on_two_keys_add_up_to_what_the_answers_reported(
    tiny_alias, mlx_engine, django_user_model
):
    """KEY-2: every surface (chat, completions, Responses, Messages, streamed or not, and the
    WebSocket) records each turn's prompt, cached and output tokens against its key and owner,
    exactly what the answer reported; nothing is written until the flush (write-behind)."""
    alice, alice_key = await sync_to_async(user_with_key)(django_user_model, "alice")
    bob, bob_key = await sync_to_async(user_with_key)(django_user_model, "bob")
    reported = {alice_key: [0, 0, 0, 0], bob_key: [0, 0, 0, 0]}
    for turn in range(20):
        key = (alice_key, bob_key)[turn % 2]
        surface = SURFACES[(turn // 2) % len(SURFACES)]
        counts = await surface(key)
        assert counts[0] > 0 and counts[2] > 0, (surface.__name__, counts)
        totals = reported[key]
        totals[0] += 1
        for index, value in enumerate(counts, start=1):
            totals[index] += value

    assert await UsageDay.objects.acount() == 0  # nothing on the request path: tallied in memory
    await usage.recorder().flush()

    for key in (alice_key, bob_key):
        requests, prompt, cached, output = reported[key]
        assert await sync_to_async(rows_of)(key) == {
            "requests": requests,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "output_tokens": output,
        }
    assert reported[alice_key][2] > 0  # repeated prompts hit the prefix cache: cached tokens count
    assert await UsageDay.objects.acount() == 2  # one row per key per day
    row = await UsageDay.objects.select_related("key").aget(owner=alice)
    assert row.key.owner_id == alice.pk and row.day == limits.utc_day(time.time())
    assert await UsageDay.objects.filter(owner=bob).acount() == 1


async def test_a_second_flush_adds_to_the_days_row(tiny_alias, api_key, mlx_engine):
    """KEY-2: the day's row is incremented in place (F() expressions), never duplicated."""
    first = await chat(api_key)
    await usage.recorder().flush()
    second = await chat(api_key)
    await usage.recorder().flush()
    row = await UsageDay.objects.aget()
    assert (row.requests, row.prompt_tokens, row.output_tokens) == (
        2,
        first[0] + second[0],
        first[2] + second[2],
    )


async def test_a_client_that_hangs_up_still_has_its_tokens_counted(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """KEY-2: the tally is taken when the engine posts the turn's end, not when a client reads it."""
    body = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 5000,
        "stream": True,
        "logit_bias": {str(tiny_eos_id): -100},
    }
    reader = StreamReader(await post_json("/v1/chat/completions", body, bearer(api_key)))
    await reader.wait_for(4)
    await reader.hang_up()
    recorder = usage.recorder()
    [tally] = (await eventually(recorder.pending, timeout=30)).values()
    assert tally.requests == 1 and tally.output_tokens >= 2 and tally.prompt_tokens > 0
    await recorder.flush()
    row = await UsageDay.objects.aget()
    assert (row.requests, row.output_tokens) == (1, tally.output_tokens)


async def test_a_used_key_gets_its_last_used_at_from_the_flush(tiny_alias, api_key, mlx_engine):
    """KEY-1: a request notes the key's use in memory; the flush stamps `last_used_at`."""
    assert (await AsyncClient().get("/v1/models", headers=bearer(api_key))).status_code == 200  # any call
    assert (await ApiKey.objects.aget()).last_used_at is None  # nothing written on the request path
    await usage.recorder().flush()
    stamped = (await ApiKey.objects.aget()).last_used_at
    assert stamped is not None
    await chat(api_key)
    await usage.recorder().flush()
    assert (await ApiKey.objects.aget()).last_used_at == stamped  # at most once a minute per key


# Limits (KEY-4) ---------------------------------------------------------------------------------


async def set_limits(key: str, **limits_: int | None) -> None:
    row = await ApiKey.objects.aget(prefix=key[:13])
    fields = {"requests_per_minute": None, "tokens_per_day": None, **limits_}
    await sync_to_async(services.apikey_update)(key=row, name=row.name, **fields)


async def refused_everywhere(key: str) -> None:
    """Each surface answers the limit with 429, Retry-After and its own envelope."""
    chat_ = await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(key))
    assert chat_.status_code == 429 and int(chat_["Retry-After"]) >= 1
    error = chat_.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] in ("requests", "tokens")

    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "x"}),
        ("/v1/responses", {"model": "tiny", "input": "x"}),
    ):
        answer = await post_json(path, body, bearer(key))
        assert answer.status_code == 429 and int(answer["Retry-After"]) >= 1, path
        assert answer.json()["error"]["code"] == "rate_limit_exceeded", path

    anthropic_ = await post_json(
        "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO}, anthropic(key)
    )
    assert anthropic_.status_code == 429 and int(anthropic_["Retry-After"]) >= 1
    assert anthropic_.json()["type"] == "error"
    assert anthropic_.json()["error"]["type"] == "rate_limit_error"

    socket = await connect(key_headers(key))
    try:
        await ws_create(socket, input="x", store=False)
        [frame] = await frames_until(socket, "error")
        assert frame["status"] == 429 and frame["retry_after"] >= 1
        assert frame["error"]["code"] == "rate_limit_exceeded"
    finally:
        await socket.disconnect()


async def test_a_key_over_its_requests_per_minute_gets_429_on_every_surface(tiny_alias, api_key, mlx_engine):
    """KEY-4: at most N turns in any 60 s; the next is refused before it takes a lane slot, with
    Retry-After and each surface's envelope. A key without limits is never counted."""
    await set_limits(api_key, requests_per_minute=2)
    assert (await chat(api_key))[2] > 0
    assert (await messages(api_key))[2] > 0
    await refused_everywhere(api_key)
    answer = await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(api_key))
    assert 1 <= int(answer["Retry-After"]) <= 60
    assert "requests per min (RPM): Limit 2, Used 2" in answer.json()["error"]["message"]
    assert mlx_engine.snapshot()[0]["lane"]["active"] == 0

    await set_limits(api_key)  # back to no limit: in force at once in this process
    assert (await chat(api_key))[2] > 0


async def test_a_key_over_its_tokens_per_day_gets_429_until_midnight(tiny_alias, api_key, mlx_engine):
    """KEY-4: tokens are counted by the usage flush; once the day's count reaches the limit every
    surface refuses with Retry-After up to the next UTC midnight."""
    await set_limits(api_key, tokens_per_day=10)
    used = await chat(api_key)  # under the limit when it arrived
    await usage.recorder().flush()
    row = await ApiKey.objects.aget()
    assert limits.limiter().tokens_used(row.pk, limits.utc_day(time.time())) == used[0] + used[2] >= 10
    await refused_everywhere(api_key)
    answer = await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(api_key))
    assert answer.json()["error"]["type"] == "tokens"
    assert 1 <= int(answer["Retry-After"]) <= 86_400


async def test_a_browser_session_turn_counts_against_its_user(tiny_alias, mlx_engine, user):
    """KEY-2: a turn over the WebSocket with a login (no key) is its user's usage, key empty."""
    client = AsyncClient()
    await client.aforce_login(user)
    cookie = (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())
    socket = await connect([WS_HOST, cookie, (b"origin", b"http://testserver")])
    await ws_create(socket, input="hi", max_output_tokens=3, store=False)
    frames = await frames_until(socket, "response.completed", "response.incomplete")
    await socket.disconnect()
    await usage.recorder().flush()
    row = await UsageDay.objects.aget()
    assert (row.owner_id, row.key_id, row.requests) == (user.pk, None, 1)
    assert row.output_tokens == frames[-1]["response"]["usage"]["output_tokens"]


# Embeddings, count_tokens and refusals (issue 25) ------------------------------------------------


async def embed(key: str, value) -> tuple[int, int]:
    response = await post_json("/v1/embeddings", {"model": "minilm", "input": value}, bearer(key))
    return response.status_code, (response.json().get("usage") or {}).get("prompt_tokens", 0)


async def count(key: str):
    body = {"model": "tiny", "messages": HELLO}
    return await post_json("/v1/messages/count_tokens", body, anthropic(key))


async def test_embeddings_and_counts_are_in_the_keys_usage(tiny_alias, minilm_alias, api_key, mlx_engine):
    """KEY-2: an embedding request adds one request and exactly the input tokens its answer
    reported; a count_tokens call adds a count, no request and no tokens."""
    status, first = await embed(api_key, ["hello there", "a second input"])
    assert status == 200 and first > 0
    status, second = await embed(api_key, [791, 8415, 23874])  # a token array
    assert status == 200 and second > 0
    counted = await count(api_key)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    await usage.recorder().flush()
    row = await UsageDay.objects.aget()
    assert (row.requests, row.prompt_tokens, row.output_tokens) == (2, first + second, 0)
    assert row.count_requests == 1


async def test_a_key_over_its_limits_is_refused_on_embeddings(minilm_alias, api_key, mlx_engine):
    """KEY-4: embeddings count against the key's requests per minute and the day's tokens, with
    OpenAI's 429 envelope and Retry-After."""
    await set_limits(api_key, requests_per_minute=1)
    assert (await embed(api_key, "hello"))[0] == 200
    refused = await post_json("/v1/embeddings", {"model": "minilm", "input": "again"}, bearer(api_key))
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "requests"

    await set_limits(api_key, tokens_per_day=3)
    await usage.recorder().flush()  # the first request's tokens reach the day's counter
    refused = await post_json("/v1/embeddings", {"model": "minilm", "input": "again"}, bearer(api_key))
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"


async def test_count_tokens_has_a_requests_window_of_its_own(tiny_alias, api_key, mlx_engine):
    """KEY-4: count_tokens is held to the key's requests per minute in a window apart from turns
    (a key at its limit may still count, and counting spends no turn), and never to the day's
    tokens; over it, Anthropic's 429 `rate_limit_error`."""
    await set_limits(api_key, requests_per_minute=2, tokens_per_day=1)
    assert (await count(api_key)).status_code == 200
    assert (await count(api_key)).status_code == 200
    refused = await count(api_key)
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    assert (await chat(api_key))[2] > 0  # the turns' window is untouched by the counts
    await usage.recorder().flush()  # now over the day's tokens: turns are refused, counts are not
    assert (
        await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(api_key))
    ).status_code == 429
    await set_limits(api_key, requests_per_minute=None, tokens_per_day=1)
    assert (await count(api_key)).status_code == 200


async def test_refused_requests_are_counted_per_key(
    tiny_alias, minilm_alias, api_key, mlx_engine, tiny_eos_id
):
    """KEY-2: a 429 by the key's limits counts as `rate_limited`, a full queue (429 queue_full,
    Anthropic 529) as `overloaded`, each in the key's row for the day, on turns and embeddings."""
    from tests.api.support import set_lane

    await set_limits(api_key, requests_per_minute=1)
    assert (await chat(api_key))[2] > 0
    for _ in range(2):
        assert (
            await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(api_key))
        ).status_code == 429
    assert (await embed(api_key, "hello"))[0] == 429
    await set_limits(api_key)

    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    body = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 5000,
        "stream": True,
        "logit_bias": {str(tiny_eos_id): -100},
    }
    reader = StreamReader(await post_json("/v1/chat/completions", body, bearer(api_key)))
    await reader.wait_for(2)
    full = await post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO}, bearer(api_key))
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    overloaded = await post_json(
        "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO}, anthropic(api_key)
    )
    assert overloaded.status_code == 529
    await reader.hang_up()

    await usage.recorder().flush()
    row = await UsageDay.objects.aget()
    assert (row.rate_limited, row.overloaded) == (3, 2)
