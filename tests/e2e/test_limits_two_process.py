"""Per-key limits shared by two processes through Redis (KEY-4): this test process serves turns
and counts them; a real second daphne, on the same Redis and database, refuses the key's next
turn with 429 and Retry-After.

Redis is the real one at REDIS_URL (default 127.0.0.1:6379): a missing Redis fails this test.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from mlxhost.runtime import PROCESS
from models_app.accounting import limits, usage
from models_app.catalogue import services
from tests.api.support import post_json
from tests.conftest import redis_keys_delete
from tests.e2e.conftest import database_url, spawn_daphne, stop_process, wait_until_up

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def shared_prefix():
    prefix = f"mlxhost-test-two-process:{uuid.uuid4().hex}"
    yield prefix
    redis_keys_delete(REDIS_URL, f"{prefix}:*")


async def test_a_key_over_its_limit_is_refused_by_a_second_process_too(
    tiny_alias, user, mlx_engine, tmp_path, shared_prefix
):
    """KEY-4: two turns here use up a 2-per-minute key; the other process answers its third with
    429 `rate_limit_exceeded` and Retry-After (and Anthropic's `rate_limit_error`), and a key whose
    daily tokens this process flushed is refused there as well."""
    here = limits.RedisLimiter(REDIS_URL, prefix=shared_prefix)
    PROCESS.put(limits.LIMITER, here)
    _, raw = await sync_to_async(services.apikey_create)(owner=user, name="shared", requests_per_minute=2)
    _, thrifty = await sync_to_async(services.apikey_create)(owner=user, name="thrifty", tokens_per_day=5)
    env = {
        "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
        "DATABASE_URL": await sync_to_async(database_url)(),
        "REDIS_URL": REDIS_URL,
        "MLXHOST_LIMITS_PREFIX": shared_prefix,
        "MLXHOST_PRELOAD": "false",
        "MLXHOST_CELERY_QUEUE": f"mlxhost-e2e-{uuid.uuid4().hex[:12]}",
        "PYTHONUNBUFFERED": "1",
    }
    other = await asyncio.to_thread(spawn_daphne, {**os.environ, **env}, tmp_path / "daphne.log")
    try:
        await asyncio.to_thread(wait_until_up, other)
        for _ in range(2):
            answer = await post_json(
                "/v1/chat/completions",
                {"model": "tiny", "messages": HELLO, "max_tokens": 3},
                {"Authorization": f"Bearer {raw}"},
            )
            assert answer.status_code == 200, answer.content

        async with httpx.AsyncClient(base_url=other.url, timeout=30) as http:
            refused = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": HELLO},
                headers={"Authorization": f"Bearer {raw}"},
            )
            assert refused.status_code == 429, refused.text
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
            assert "Limit 2, Used 2" in error["message"]

            anthropic = await http.post(
                "/v1/messages",
                json={"model": "tiny", "max_tokens": 3, "messages": HELLO},
                headers={"x-api-key": raw, "anthropic-version": "2023-06-01"},
            )
            assert anthropic.status_code == 429 and int(anthropic.headers["Retry-After"]) >= 1
            assert anthropic.json() == {
                "type": "error",
                "error": {"type": "rate_limit_error", "message": error["message"]},
            }

            # Tokens: a turn here, flushed, fills the other key's day for every process.
            answer = await post_json(
                "/v1/chat/completions",
                {"model": "tiny", "messages": HELLO, "max_tokens": 3},
                {"Authorization": f"Bearer {thrifty}"},
            )
            assert answer.status_code == 200
            await usage.recorder().flush()
            spent = await http.post(
                "/v1/responses",
                json={"model": "tiny", "input": "hi"},
                headers={"Authorization": f"Bearer {thrifty}"},
            )
            assert spent.status_code == 429, spent.text
            assert spent.json()["error"]["type"] == "tokens"
            assert int(spent.headers["Retry-After"]) >= 1
        assert json.loads(answer.content)["usage"]["total_tokens"] >= 5
    finally:
        await asyncio.to_thread(stop_process, other.process)
        await here.aclose()
        here.close()
        # The views here read keys on asgiref's thread: close its connection before the test
        # database is dropped.
        await sync_to_async(connections.close_all)()
