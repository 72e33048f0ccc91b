"""This process's engine and its lifecycle: one `Process` that holds what exists once per process
and runs the start and stop hooks it was given.

The lifecycle knows nothing of what runs beside the engine. The composition root
(`mlxhost.composition.HOOKS`) lists every hook in one place and installs them: the write-behind
store, control (reconcile, the listener), the status publisher, the usage flush and the sockets'
close. Start hooks run in their listed order once the server's loop runs; stop hooks run after
the drain, by stage and then in listed order (OPS-5). The process-wide objects (the engine, the
write-behind store, the usage recorder, the limiter, the admin actions) are `Shared` slots held
by `PROCESS`: built on first use, swapped by tests with `PROCESS.put`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from django.conf import settings

from mlxhost.engine import Engine, EngineClosedError

if TYPE_CHECKING:
    from mlxhost.runtime.config import RuntimeSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Identifies this process's lifetime on every stored response (REG-4).
BOOT_ID = uuid.uuid4().hex

# Shutdown (OPS-5): beyond the drain, how long the workers may take, and the bound each stop
# stage's hooks get when they have no timeout of their own.
STOP_GRACE_S = 5.0

StartHook = Callable[[Engine], None]
ShutdownHook = Callable[[], None]
StopHook = Callable[[], Awaitable[None]]


class StopStage(IntEnum):
    """When a stop hook runs, after the engine has drained (OPS-5)."""

    FLUSH = 1  # write what the drained turns left behind (stored responses)
    CLOSE = 2  # then close what clients still hold open (WebSockets)


@dataclass(frozen=True, slots=True)
class Hooks:
    """What runs beside the engine: `start` hooks get the engine once the server's loop runs and
    start background work with `spawn`; `shutdown_begin` hooks run the moment shutdown begins,
    before the server cancels its connections; `stop` hooks are awaited after the drain, by stage."""

    start: tuple[StartHook, ...] = ()
    shutdown_begin: tuple[ShutdownHook, ...] = ()
    stop: tuple[tuple[StopStage, StopHook], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Shared(Generic[T]):
    """One object the whole process shares, held by `PROCESS` and built by `build` on first use
    (None: nothing builds it; its owner puts it)."""

    name: str
    build: Callable[[], T] | None = None


@dataclass(slots=True, eq=False)
class Process:
    """This serving process: its shared objects, its installed hooks and its background tasks."""

    shared: dict[Shared[Any], Any] = field(default_factory=dict)
    hooks: Hooks = field(default_factory=Hooks)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    stop_task: asyncio.Task[None] | None = None

    def get(self, slot: Shared[T]) -> T:
        """`slot`'s object, built now if nothing has built or put one yet."""
        if (value := self.peek(slot)) is None:
            if slot.build is None:
                raise LookupError(f"nothing has put the process's {slot.name}")
            value = self.shared[slot] = slot.build()
        return value

    def peek(self, slot: Shared[T]) -> T | None:
        """`slot`'s object if something built it; probes and metrics use this so they build nothing."""
        return cast("T | None", self.shared.get(slot))

    def put(self, slot: Shared[T], value: T | None) -> None:
        """Swap `slot`'s object (None: the next `get` builds a fresh one)."""
        if value is None:
            self.shared.pop(slot, None)
        else:
            self.shared[slot] = value

    def install(self, hooks: Hooks) -> None:
        """Add `hooks` after those installed already (the composition root installs one list)."""
        self.hooks = Hooks(
            start=(*self.hooks.start, *hooks.start),
            shutdown_begin=(*self.hooks.shutdown_begin, *hooks.shutdown_begin),
            stop=(*self.hooks.stop, *hooks.stop),
        )

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Run `coro` in the background until it ends or the engine stops (which cancels it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)  # keep a reference until done, or the task may be collected
        task.add_done_callback(self.tasks.discard)
        return task


# The engine ---------------------------------------------------------------------------------------


def runtime_settings() -> RuntimeSettings:
    """This process's runtime settings (`settings.MLXHOST_RUNTIME`, parsed once at startup)."""
    value: RuntimeSettings = settings.MLXHOST_RUNTIME
    return value


def _build_engine() -> Engine:
    config = runtime_settings()
    if not config.run_engine:
        raise EngineClosedError("This process does not serve models (MLXHOST_RUN_ENGINE=false).")
    return Engine(config.engine)


# Tests put one with a fake backend or a fresh loop.
ENGINE: Shared[Engine] = Shared("engine", _build_engine)
PROCESS = Process()


def get_engine() -> Engine:
    """This process's engine, built on first use (never in AppConfig.ready, which runs for migrate too).

    Raises:
        EngineClosedError: this process serves no models (`MLXHOST_RUN_ENGINE=false`).
    """
    return PROCESS.get(ENGINE)


def engine_if_started() -> Engine | None:
    """The engine if something already built it; probes use this so they never load models."""
    return PROCESS.peek(ENGINE)


def spawn(coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
    """Run `coro` in the background on `PROCESS` until it ends or the engine stops."""
    return PROCESS.spawn(coro, name=name)


# Start and stop -----------------------------------------------------------------------------------


async def engine_start() -> None:
    """Build the engine, start its housekeeping, then run every start hook in order (ADM-3)."""
    engine = get_engine()
    spawn(engine.housekeeping(), name="engine-housekeeping")
    for hook in PROCESS.hooks.start:
        hook(engine)
    # What is imported by now lives as long as the process: keep it out of the cyclic collector,
    # whose full passes over it stalled the loop for ~100 ms (refusals in a burst, RELIABILITY.md).
    # Before the models load (the start hooks only scheduled that), so an unloaded model's
    # objects stay collectable.
    gc.freeze()


async def engine_stop() -> None:
    """Drain and stop this process's engine, then run the stop hooks (OPS-5, LANE-7).

    New requests get 503 `draining`, queued ones too; running streams get SHUTDOWN_TIMEOUT_S
    to finish, then are aborted, and each still ends with its terminal event. Bounded: a wedged
    load or hook is logged and left behind, never waited for without end.
    """
    started = list(PROCESS.tasks)
    for task in started:  # control messages, status, housekeeping: nothing new starts
        task.cancel()
    if started:
        await asyncio.wait(started, timeout=STOP_GRACE_S)
    if (engine := engine_if_started()) is not None:
        timeout = engine.config.shutdown_timeout_s
        logger.info("draining the engine (up to %.0fs)", timeout)
        try:
            await asyncio.wait_for(engine.shutdown(), 2 * timeout + STOP_GRACE_S)
        except TimeoutError:
            logger.error("the engine did not stop in time; exiting anyway")
        except Exception:  # the process exits either way; say why it was not clean
            logger.exception("draining the engine failed")
    for _stage, hook in sorted(PROCESS.hooks.stop, key=lambda item: item[0]):  # stable: listed order
        try:
            await hook()
        except Exception:
            logger.exception("stop hook %s failed", getattr(hook, "__qualname__", hook))
    logger.info("engine stopped")


# Daphne -------------------------------------------------------------------------------------------


def schedule_engine_start() -> None:
    """Called from asgi.py: start the engine once daphne's reactor (and its asyncio loop) runs,
    and drain it before the reactor shuts down (OPS-5).

    Daphne imports the application before it sets its loop as current, so the start is
    deferred with the reactor's `callWhenRunning`. Under other ASGI servers models load on
    their first request instead.
    """
    if "twisted.internet.reactor" not in sys.modules or not runtime_settings().run_engine:
        return
    from twisted.internet import reactor

    # callWhenRunning fires as the reactor starts, before asyncio's loop is "running";
    # call_soon defers once more so create_task sees a running loop.
    reactor.callWhenRunning(lambda: asyncio.get_event_loop().call_soon(_start_on_running_loop))
    # SIGTERM/SIGINT stop the reactor; it waits for this Deferred before it closes connections
    # and the loop (OPS-5). Daphne's own before-shutdown trigger cancels each request's ASGI
    # task at the same moment, but Django runs the view and its streaming response in a task of
    # its own that outlives that cancel, so streams still end with their terminal event
    # (tests/e2e/test_shutdown.py proves it with a real daphne).
    # Twisted declares IReactorCore's methods zope-style, without `self`; with no mypy-zope
    # plugin mypy reads the first parameter as `self` and shifts the rest by one.
    reactor.addSystemEventTrigger("before", "shutdown", _drain_before_shutdown)  # type: ignore[arg-type]


def _start_on_running_loop() -> None:
    spawn(engine_start(), name="engine-start")


def _drain_before_shutdown() -> Any:
    from twisted.internet.defer import Deferred

    if PROCESS.stop_task is None:
        for hook in PROCESS.hooks.shutdown_begin:  # before daphne's own trigger cancels the consumers' tasks
            try:
                hook()
            except Exception:
                logger.exception("shutdown hook %s failed", getattr(hook, "__qualname__", hook))
        PROCESS.stop_task = asyncio.ensure_future(engine_stop())
    return Deferred.fromFuture(PROCESS.stop_task)


SERVED_THROUGH_SHUTDOWN = frozenset({"http", "websocket"})


class ServeThroughShutdown:
    """ASGI middleware for HTTP and WebSockets: when daphne cancels every request and consumer at
    shutdown, keep each running, so a client that leaves during the drain still cancels its turns
    (Django's disconnect listener; a consumer's `disconnect`, API-3, LANE-6) instead of the host
    generating for nobody until the drain timeout. The drain ends whatever else still runs, and
    `api.ws.tracking.close_open_sockets` the consumers left after it (OPS-5). Any other cancel
    (daphne's `application_close_timeout`, other servers) goes through as before."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] not in SERVED_THROUGH_SHUTDOWN:
            await self.app(scope, receive, send)
            return
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if PROCESS.stop_task is None:  # not the shutdown (it starts before daphne cancels)
                task.cancel()
            task.add_done_callback(_report_unexpected)
            raise


def _report_unexpected(task: asyncio.Future[None]) -> None:
    # The handler or consumer outlived its caller: nobody else will look at how it ended.
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("a request or WebSocket consumer failed during shutdown", exc_info=error)
