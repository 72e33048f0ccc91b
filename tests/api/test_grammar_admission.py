"""A grammar is checked before its request takes a lane permit (issue 25 follow-up, API-7)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxhost.engine.backends.mlx.backend import MlxModel
from tests.api.support import post_chat, set_lane

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

SLOW = {
    "type": "object",
    "description": "slow to compile",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
}


@pytest.fixture
def slow_check(monkeypatch):
    """The model's grammar check blocks on SLOW's schema until `release` is set."""
    entered, release = threading.Event(), threading.Event()
    check = MlxModel.check_grammar

    def blocking(self, grammar, param):
        if "slow to compile" in grammar.source:
            entered.set()
            release.wait(60)
        return check(self, grammar, param)

    monkeypatch.setattr(MlxModel, "check_grammar", blocking)
    yield entered, release
    release.set()


async def test_a_slow_grammar_check_holds_no_place_in_the_lane(tiny_alias, api_key, mlx_engine, slow_check):
    """One slot, no queue: while a schema compiles, the lane holds no permit, nothing active or
    queued, and another request is served (it would be a 429 if the compile held its place)."""
    entered, release = slow_check
    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    assert (await post_chat(api_key, max_tokens=2)).status_code == 200  # loaded: its vocabulary checks
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW}}
    slow = asyncio.create_task(post_chat(api_key, max_tokens=8, response_format=fmt))
    assert await asyncio.to_thread(entered.wait, 60)
    lane = mlx_engine.registry.bound("tiny").lane
    assert (lane.permits, lane.active, lane.queued) == (0, 0, 0)
    other = await post_chat(api_key, max_tokens=2)
    assert other.status_code == 200, other.content
    release.set()
    assert (await slow).status_code == 200
