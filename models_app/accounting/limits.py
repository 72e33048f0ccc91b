"""Per-key limits (KEY-4): requests in any 60 seconds and tokens per UTC day, checked when a turn
arrives on any surface; shared by every process through Redis when REDIS_URL is set, counted in
this process otherwise.

Requests are a sliding log (at most N starts in any 60 s, never 2N across a minute boundary),
taken atomically with the check in one Lua script. Tokens are counted by the usage flush
(`models_app.accounting.usage`), for every key, so a limit set in the middle of a day already knows what
the key used that day; a turn's tokens count from the next flush, so a key may overshoot its
daily budget by what it runs meanwhile. When Redis fails the limits are not enforced (logged):
an outage of the limiter never refuses paying traffic.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Literal, Protocol

from django.conf import settings

from mlxhost.runtime import PROCESS, Shared

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

WINDOW_S = 60
DAY_S = 86_400
# Token counters outlive their day by one, so a clock a little behind still finds them.
TOKENS_TTL_S = 2 * DAY_S
REDIS_TIMEOUT_S = 0.5
REQUESTS_MESSAGE = (
    "Rate limit reached for this API key on requests per min (RPM): Limit {limit}, Used {used}. "
    "Please try again in {retry}s."
)
TOKENS_MESSAGE = (
    "Rate limit reached for this API key on tokens per day (TPD): Limit {limit}, Used {used}. "
    "Please try again in {retry}s."
)

# KEYS: the key's request log (a sorted set of start times), its token counter for today.
# ARGV: now (ms), window (ms), requests limit (0: none), tokens limit (0: none), a unique member.
# Returns {0} (admitted), {1, retry_ms, used} (requests) or {2, used} (tokens).
ADMIT_SCRIPT = """
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local rpm = tonumber(ARGV[3])
local tpd = tonumber(ARGV[4])
if tpd > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= tpd then return {2, used} end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  local used = redis.call('ZCARD', KEYS[1])
  if used >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {1, tonumber(oldest[2]) + window - now, used}
  end
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], window)
end
return {0}
"""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """An API key's limits; None is no limit."""

    requests_per_minute: int | None = None
    tokens_per_day: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_day)


class RateLimitedError(Exception):
    """The key crossed one of its limits (KEY-4): a 429 with Retry-After on every surface."""

    code = "rate_limit_exceeded"

    def __init__(
        self, kind: Literal["requests", "tokens"], *, limit: int, used: int, retry_after: int
    ) -> None:
        template = REQUESTS_MESSAGE if kind == "requests" else TOKENS_MESSAGE
        super().__init__(template.format(limit=limit, used=used, retry=retry_after))
        self.kind, self.limit, self.used, self.retry_after = kind, limit, used, retry_after


# (key id, UTC day) -> tokens the flush adds to the key's daily counter.
TokenCounts = Mapping[tuple[int, date], int]


# The request log a request is counted in: turns and embeddings share one; `count_tokens` has a
# window of its own, with the same limit (KEY-4).
Window = Literal["requests", "counts"]


class Limiter(Protocol):
    async def admit(self, key_id: int, limits: KeyLimits, *, window: Window = "requests") -> None:
        """Count one request of `key_id` against its limits, in `window`'s request log.

        Raises:
            RateLimitedError: over a limit (the turn is not counted).
        """

    def add_tokens(self, counts: TokenCounts) -> None:
        """Add tokens the keys used (called by the usage flush, in its thread)."""

    def tokens_used(self, key_id: int, day: date) -> int:
        """What the daily counter of `key_id` says for `day`."""


def utc_day(at: float) -> date:
    return datetime.fromtimestamp(at, UTC).date()


def seconds_to_midnight(at: float) -> int:
    return max(1, math.ceil(DAY_S - at % DAY_S))


def _tokens_refused(limits: KeyLimits, used: int, now: float) -> RateLimitedError:
    assert limits.tokens_per_day is not None
    return RateLimitedError(
        "tokens", limit=limits.tokens_per_day, used=used, retry_after=seconds_to_midnight(now)
    )


class LocalLimiter:
    """The limits of one process, for a server without Redis (each process counts its own)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the flush adds tokens from its thread
        self._starts: dict[tuple[int, Window], deque[float]] = {}
        self._tokens: dict[tuple[int, date], int] = {}

    async def admit(self, key_id: int, limits: KeyLimits, *, window: Window = "requests") -> None:
        now = self._clock()
        with self._lock:
            if limits.tokens_per_day:
                used = self._tokens.get((key_id, utc_day(now)), 0)
                if used >= limits.tokens_per_day:
                    raise _tokens_refused(limits, used, now)
            if limits.requests_per_minute:
                starts = self._starts.setdefault((key_id, window), deque())
                while starts and starts[0] <= now - WINDOW_S:
                    starts.popleft()
                if len(starts) >= limits.requests_per_minute:
                    retry = max(1, math.ceil(starts[0] + WINDOW_S - now))
                    raise RateLimitedError(
                        "requests", limit=limits.requests_per_minute, used=len(starts), retry_after=retry
                    )
                starts.append(now)

    def add_tokens(self, counts: TokenCounts) -> None:
        today = utc_day(self._clock())
        with self._lock:
            for key, tokens in counts.items():
                self._tokens[key] = self._tokens.get(key, 0) + tokens
            for key in [k for k in self._tokens if (today - k[1]).days > 1]:
                del self._tokens[key]  # yesterday's may still be read by a clock a little behind

    def tokens_used(self, key_id: int, day: date) -> int:
        with self._lock:
            return self._tokens.get((key_id, day), 0)


class RedisLimiter:
    """The limits of every process that shares this Redis and `prefix`."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        timeout_s: float = REDIS_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url, self.prefix, self.timeout_s = url, prefix, timeout_s
        self._clock = clock
        # redis.asyncio connections belong to the loop that opened them: one client per loop.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
            weakref.WeakKeyDictionary()
        )
        self._sync: redis.Redis | None = None
        self._sync_lock = threading.Lock()

    def requests_key(self, key_id: int, window: Window = "requests") -> str:
        return f"{self.prefix}:{key_id}:{window}"

    def tokens_key(self, key_id: int, day: date) -> str:
        return f"{self.prefix}:{key_id}:tokens:{day.isoformat()}"

    def _client(self) -> aioredis.Redis:
        import redis.asyncio as aioredis

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
            )
        return client

    async def admit(self, key_id: int, limits: KeyLimits, *, window: Window = "requests") -> None:
        import redis

        now = self._clock()
        keys = [self.requests_key(key_id, window), self.tokens_key(key_id, utc_day(now))]
        args: list[int | str] = [
            int(now * 1000),
            WINDOW_S * 1000,
            limits.requests_per_minute or 0,
            limits.tokens_per_day or 0,
            f"{int(now * 1000)}-{secrets.token_hex(4)}",
        ]
        try:
            answer = await self._client().eval(ADMIT_SCRIPT, len(keys), *keys, *args)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            logger.warning("per-key limits not checked: Redis failed (%s)", exc)
            return
        if answer[0] == 1:
            assert limits.requests_per_minute is not None
            retry = max(1, math.ceil(int(answer[1]) / 1000))
            raise RateLimitedError(
                "requests", limit=limits.requests_per_minute, used=int(answer[2]), retry_after=retry
            )
        if answer[0] == 2:
            raise _tokens_refused(limits, int(answer[1]), now)

    def _sync_client(self) -> redis.Redis:
        import redis

        with self._sync_lock:
            if self._sync is None:
                self._sync = redis.Redis.from_url(
                    self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
                )
            return self._sync

    def add_tokens(self, counts: TokenCounts) -> None:
        import redis

        if not counts:
            return
        try:
            with self._sync_client().pipeline(transaction=False) as pipe:
                for (key_id, day), tokens in counts.items():
                    pipe.incrby(self.tokens_key(key_id, day), tokens)
                    pipe.expire(self.tokens_key(key_id, day), TOKENS_TTL_S)
                pipe.execute()
        except (redis.RedisError, OSError) as exc:
            logger.warning("token counters not updated: Redis failed (%s)", exc)

    def tokens_used(self, key_id: int, day: date) -> int:
        value = self._sync_client().get(self.tokens_key(key_id, day))
        return int(value) if value is not None else 0

    async def aclose(self) -> None:
        """Close this loop's connections (tests end their loop; a server keeps its one)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def close(self) -> None:
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None


def _build_limiter() -> Limiter:
    url = settings.REDIS_URL
    return RedisLimiter(url, prefix=settings.MLXHOST_LIMITS_PREFIX) if url else LocalLimiter()


# This process's limiter (tests put one on their own Redis prefix).
LIMITER: Shared[Limiter] = Shared("limiter", _build_limiter)


def limiter() -> Limiter:
    """This process's limiter: Redis's when REDIS_URL is set, else one of its own."""
    return PROCESS.get(LIMITER)
