"""Helpers shared by the test packages: waiting on conditions, a fake clock, channel-group joins.

Tests wait on a condition with a deadline, never for a fixed time: `wait_until` (blocking, for
tests that talk to another process) and `eventually` (awaited, for tests on the event loop).
Both return the predicate's first truthy value and fail with what they waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

T = TypeVar("T")


class FakeClock:
    """A settable monotonic clock for `Engine(clock=...)` or `Lane(clock=...)`; `advance()` moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _timed_out(predicate: Callable[..., object], timeout: float, what: str, value: object) -> AssertionError:
    """The failure: what was awaited (by default the predicate's own source line) and its last value."""
    if not what:
        try:
            what = inspect.getsource(predicate).strip()
        except (OSError, TypeError):
            what = repr(predicate)
    return AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {value!r})")


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> T:
    """Call `predicate` until it returns something truthy and return that; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(predicate, timeout, what, value)
        time.sleep(interval)


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 5.0,
    interval: float = 0.005,
    what: str = "",
) -> T:
    """Await until `predicate` (plain or async) gives something truthy and return it; fail after
    `timeout` seconds of loop time. Polls with short sleeps so the loop keeps running meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _timed_out(predicate, timeout, what, value)
        await asyncio.sleep(interval)


def watch_group_joins(monkeypatch: Any, layer: Any, group: str) -> asyncio.Event:
    """An event set once any channel has joined `group` on `layer` (in-memory or Redis alike).

    Wraps the layer instance's `group_add`, so a test can wait for a listener to have joined
    before it sends to the group, instead of sleeping and hoping it has.
    """
    joined = asyncio.Event()
    group_add = layer.group_add

    async def watched(name: str, channel: str) -> None:
        await group_add(name, channel)
        if name == group:
            joined.set()

    monkeypatch.setattr(layer, "group_add", watched)
    return joined


def user_with_key(django_user_model: Any, username: str, **user_fields: Any) -> tuple[Any, str]:
    """A new user (password `pw-<username>-123`) and the raw text of a fresh API key of theirs."""
    from models_app.catalogue import services

    user = django_user_model.objects.create_user(
        username=username, password=f"pw-{username}-123", **user_fields
    )
    _, raw = services.apikey_create(owner=user, name=username)
    return user, raw


def register_alias(*, name: str, folder: str = "tiny-llama", **fields: Any) -> Any:
    """Register alias `name` for the local model folder `folder` (under MODELS_ROOT), as the admin
    does; `fields` are the alias's other settings. The one place tests create aliases."""
    from models_app.catalogue import services

    return services.alias_register(name=name, source_kind="local", local_path=folder, **fields)
