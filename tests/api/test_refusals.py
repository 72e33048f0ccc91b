"""Fast, exact refusals (LANE-2): a burst gets exactly capacity + depth places on every surface,
and with warm caches a refusal reaches the lane without touching the database."""

from __future__ import annotations

import asyncio

import pytest
from django.db.backends import utils as db_utils
from django.test import AsyncClient

from models_app.catalogue import hotcache, services
from tests.api.support import HELLO, every_auth, set_lane
from tests.api.support import post_any as post
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

BURST = 20
CAPACITY, DEPTH = 1, 4


def surfaces(no_eos: dict[str, int]) -> dict[str, tuple[str, dict, int]]:
    """Surface -> (path, a long-running body, its refusal status)."""
    common = {"model": "tiny", "stream": True, "logit_bias": no_eos}
    return {
        "chat": ("/v1/chat/completions", {**common, "messages": HELLO, "max_tokens": 100_000}, 429),
        "completions": ("/v1/completions", {**common, "prompt": "hello", "max_tokens": 100_000}, 429),
        "responses": (
            "/v1/responses",
            {"model": "tiny", "stream": True, "input": "hello", "max_output_tokens": 100_000, "store": False},
            429,
        ),
        "messages": (
            "/v1/messages",
            {"model": "tiny", "stream": True, "messages": HELLO, "max_tokens": 100_000},
            529,
        ),
    }


class QueryCounter:
    """Counts SQL statements from every thread (async views query on asgiref's executor thread,
    where `django_assert_num_queries` on the test thread's connection would see nothing)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = db_utils.CursorWrapper._execute

        def counted(cursor, *args, **kwargs):
            self.count += 1
            return original(cursor, *args, **kwargs)

        monkeypatch.setattr(db_utils.CursorWrapper, "_execute", counted)


async def hold_the_slot(api_key: str, no_eos: dict[str, int]):
    """A chat stream of 100k tokens in the lane's one slot: no place frees up while it runs."""
    holder = await post(api_key, "/v1/chat/completions", surfaces(no_eos)["chat"][1])
    assert holder.status_code == 200
    return holder


async def burst(api_key: str, path: str, body: dict, lane) -> tuple[list, list[asyncio.Task]]:
    """Fire BURST - 1 requests at once (the slot holder is the burst's first); return once every
    one was answered or holds a place. The count is exact however the loop interleaves them."""
    tasks = [asyncio.create_task(post(api_key, path, body)) for _ in range(BURST - 1)]

    def settled() -> bool:
        probe = lane()
        return sum(1 for task in tasks if task.done()) + probe["active"] + probe["queued"] >= BURST

    await eventually(settled, timeout=60, what="the burst to settle")
    return [task.result() for task in tasks if task.done()], tasks


async def hang_up(engine, holder, tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()  # a queued request whose client hung up
    await asyncio.gather(*tasks, return_exceptions=True)
    engine.cancel(holder["X-Request-Id"])  # the holder stops within one decode step (LANE-6)


@pytest.mark.parametrize("surface", ["chat", "completions", "responses", "messages"])
async def test_a_burst_gets_exactly_capacity_plus_depth_places_and_the_rest_are_refused(
    surface, tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-2: 20 requests at capacity 1 and depth 4: exactly 5 hold a place and 15 are refused
    with the surface's overload status (429, or 529 on Anthropic) and Retry-After."""
    await set_lane(tiny_alias, concurrency=CAPACITY, queue_depth=DEPTH)
    no_eos = {str(tiny_eos_id): -100}
    path, body, refusal = surfaces(no_eos)[surface]

    def lane():
        return mlx_engine.snapshot()[0]["lane"]

    holder = await hold_the_slot(api_key, no_eos)
    answered, tasks = await burst(api_key, path, body, lane)
    try:
        refused = [r for r in answered if r.status_code == refusal]
        assert len(refused) == BURST - CAPACITY - DEPTH == 15
        assert lane()["active"] + lane()["queued"] == CAPACITY + DEPTH == 5
        assert [r.status_code for r in answered if r.status_code != refusal] == []
        assert all(int(r["Retry-After"]) >= 1 for r in refused)
    finally:
        await hang_up(mlx_engine, holder, tasks)


@pytest.mark.parametrize("surface", ["chat", "completions", "responses", "messages"])
async def test_a_refusal_with_warm_caches_runs_no_database_query(
    surface, tiny_alias, api_key, mlx_engine, tiny_eos_id, monkeypatch
):
    """LANE-2, LANE-3: with the key and alias cached, a full lane refuses without one SQL
    statement (no key lookup, no `last_used_at` write, no alias lookup, no parent fetch), so a
    burst of refusals never queues on asgiref's one database thread."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    path, body, refusal = surfaces({str(tiny_eos_id): -100})[surface]
    if surface == "responses":  # a continuation: the permit is taken before its parent is read
        body = {**body, "previous_response_id": "resp_" + "0" * 32}
    holder = await hold_the_slot(api_key, {str(tiny_eos_id): -100})
    try:
        first = await post(api_key, path, body)  # warms the caches (the lane is full already)
        assert first.status_code == refusal
        queries = QueryCounter(monkeypatch)
        second = await post(api_key, path, body)
        assert second.status_code == refusal
        assert queries.count == 0
    finally:
        mlx_engine.cancel(holder["X-Request-Id"])


@pytest.mark.parametrize("surface", ["chat", "completions", "responses", "messages"])
async def test_a_full_lane_refuses_before_the_body_is_validated(
    surface, tiny_alias, api_key, mlx_engine, tiny_eos_id, monkeypatch
):
    """LANE-2 (issue 25 §4): a request over a full lane's budget is refused before its body goes
    through the serializers (their run was most of a refusal's time), so a body that would
    fail validation hears the overload status, and no serializer runs for it."""
    from api.openai import views

    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    path, body, refusal = surfaces({str(tiny_eos_id): -100})[surface]
    holder = await hold_the_slot(api_key, {str(tiny_eos_id): -100})
    runs = []
    original = views.validated
    for module in (
        "api.openai.views",
        "api.openai.completions",
        "api.openai.responses_views",
        "api.anthropic.views",
    ):
        monkeypatch.setattr(f"{module}.validated", lambda *args: runs.append(args) or original(*args))
    try:
        refused = await post(api_key, path, {**body, "temperature": "hot"})
        assert refused.status_code == refusal, refused.content
        assert runs == []
    finally:
        mlx_engine.cancel(holder["X-Request-Id"])
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, timeout=30, what="the slot")
    invalid = await post(api_key, path, {**body, "temperature": "hot"})
    assert invalid.status_code == 400  # with room, the same body is validated as before
    assert len(runs) == 1


async def test_a_revoked_key_is_refused_at_once_here_and_within_the_ttl_elsewhere(
    tiny_alias, api_key, user, monkeypatch
):
    """API-5: a revoke in this process clears the cached key at once; one made by another
    process (a direct row update) is refused once the cache entry expires (KEY_TTL_S <= 5 s)."""
    assert hotcache.KEY_TTL_S <= 5
    now = [1000.0]
    monkeypatch.setattr(hotcache.api_keys, "_clock", lambda: now[0])

    async def models() -> int:
        return (await AsyncClient().get("/v1/models", headers=every_auth(api_key))).status_code

    from asgiref.sync import sync_to_async

    from models_app.models import ApiKey

    assert await models() == 200
    await ApiKey.objects.filter(owner=user).aupdate(revoked_at="2026-01-01T00:00:00Z")  # "elsewhere"
    assert await models() == 200  # still cached: this is the documented window
    now[0] += hotcache.KEY_TTL_S + 0.01
    assert await models() == 401

    _, other = await sync_to_async(services.apikey_create)(owner=user, name="second")
    api_key = other
    assert await models() == 200
    key = await ApiKey.objects.aget(name="second")
    await sync_to_async(services.apikey_revoke)(key=key)
    assert await models() == 401  # no clock movement: the revoke cleared the cache
