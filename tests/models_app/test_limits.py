"""Per-key limits (KEY-4): the in-process limiter, and the Redis one shared by independent limiters.

The Redis tests use the real server at REDIS_URL (default 127.0.0.1:6379): a missing Redis fails
them, it never skips them. Each test works under a prefix of its own and deletes it after.
"""

from __future__ import annotations

import os
import uuid
from datetime import date

import pytest

from models_app.accounting.limits import (
    DAY_S,
    KeyLimits,
    LocalLimiter,
    RateLimitedError,
    RedisLimiter,
    utc_day,
)
from tests.conftest import redis_keys_delete
from tests.support import FakeClock

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
NOON = 1_800_000_000 - 1_800_000_000 % DAY_S + DAY_S / 2  # a UTC noon, so a day has 12 h left
RPM_3 = KeyLimits(requests_per_minute=3)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOON)


@pytest.fixture
def prefix():
    name = f"mlxhost-test-limits:{uuid.uuid4().hex}"
    yield name
    redis_keys_delete(REDIS_URL, f"{name}:*")


def redis_limiter(prefix: str, clock: FakeClock) -> RedisLimiter:
    return RedisLimiter(REDIS_URL, prefix=prefix, clock=clock)


async def admitted(limiter, key_id: int, limits: KeyLimits) -> bool:
    try:
        await limiter.admit(key_id, limits)
    except RateLimitedError:
        return False
    return True


async def refusal(limiter, key_id: int, limits: KeyLimits) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as refused:
        await limiter.admit(key_id, limits)
    return refused.value


@pytest.fixture(params=["local", "redis"])
def limiter(request, clock, prefix):
    if request.param == "local":
        yield LocalLimiter(clock=clock)
        return
    shared = redis_limiter(prefix, clock)
    yield shared
    shared.close()


async def test_requests_per_minute_is_a_sliding_window(limiter, clock):
    """KEY-4: at most N turns in any 60 s, never 2N across a minute boundary; Retry-After says
    when the oldest leaves the window; a refused turn does not count."""
    for _ in range(3):
        assert await admitted(limiter, 1, RPM_3)
        clock.advance(10)
    refused = await refusal(limiter, 1, RPM_3)  # 20 s after the third, 40 s after the first
    assert (refused.kind, refused.limit, refused.used, refused.retry_after) == ("requests", 3, 3, 30)
    assert refused.code == "rate_limit_exceeded"
    clock.advance(29)
    await refusal(limiter, 1, RPM_3)
    clock.advance(1.5)  # the first left the window
    assert await admitted(limiter, 1, RPM_3)
    await refusal(limiter, 1, RPM_3)
    assert await admitted(limiter, 2, RPM_3)  # keys are counted apart
    assert await admitted(limiter, 1, KeyLimits())  # no limit: never counted, never refused


async def test_the_counts_window_is_kept_apart_from_the_requests_one(limiter, clock):
    """KEY-4: count_tokens calls go in a request log of their own, with the same limit: a key at
    its requests per minute may still count, and counting never uses up its turns."""
    for _ in range(3):
        assert await admitted(limiter, 1, RPM_3)
    await refusal(limiter, 1, RPM_3)
    for _ in range(3):
        await limiter.admit(1, RPM_3, window="counts")
    with pytest.raises(RateLimitedError) as refused:
        await limiter.admit(1, RPM_3, window="counts")
    assert (refused.value.kind, refused.value.used) == ("requests", 3)
    await limiter.admit(2, RPM_3, window="counts")  # counted per key
    assert await admitted(limiter, 2, RPM_3)


async def test_tokens_per_day_refuses_until_utc_midnight(limiter, clock):
    """KEY-4: once the day's tokens reach the limit, turns are refused until the next UTC day."""
    limits = KeyLimits(tokens_per_day=100)
    today = utc_day(clock())
    limiter.add_tokens({(7, today): 60})
    assert await admitted(limiter, 7, limits)
    limiter.add_tokens({(7, today): 40})
    assert limiter.tokens_used(7, today) == 100
    refused = await refusal(limiter, 7, limits)
    assert (refused.kind, refused.used, refused.retry_after) == ("tokens", 100, DAY_S // 2)
    assert "tokens per day (TPD): Limit 100, Used 100" in str(refused)
    clock.advance(DAY_S / 2)
    assert await admitted(limiter, 7, limits)
    assert limiter.tokens_used(7, utc_day(clock())) == 0


async def test_two_independent_limiters_on_one_redis_share_the_counts(clock, prefix):
    """KEY-4: limits hold across processes: two limiters (as two processes would have) on the same
    Redis and prefix count into the same window and the same daily total."""
    first, second = redis_limiter(prefix, clock), redis_limiter(prefix, clock)
    try:
        assert await admitted(first, 1, RPM_3)
        assert await admitted(second, 1, RPM_3)
        assert await admitted(first, 1, RPM_3)
        refused = await refusal(second, 1, RPM_3)
        assert refused.used == 3 and 1 <= refused.retry_after <= 60

        day = utc_day(clock())
        first.add_tokens({(5, day): 30})
        second.add_tokens({(5, day): 30})
        assert first.tokens_used(5, day) == second.tokens_used(5, day) == 60
        await refusal(second, 5, KeyLimits(tokens_per_day=60))

        other = redis_limiter(f"{prefix}:elsewhere", clock)  # another deployment's prefix
        assert await admitted(other, 1, RPM_3)
        other.close()
    finally:
        first.close()
        second.close()


async def test_a_failing_redis_admits_and_logs(clock, caplog):
    """KEY-4: the limiter failing (Redis down) never refuses traffic; it says so in the log."""
    down = RedisLimiter("redis://127.0.0.1:1/0", prefix="nowhere", clock=clock, timeout_s=0.2)
    assert await admitted(down, 1, KeyLimits(requests_per_minute=1, tokens_per_day=1))
    assert await admitted(down, 1, KeyLimits(requests_per_minute=1, tokens_per_day=1))
    assert "per-key limits not checked" in caplog.text
    down.add_tokens({(1, date(2026, 1, 1)): 5})  # logged, not raised
    assert "token counters not updated" in caplog.text
