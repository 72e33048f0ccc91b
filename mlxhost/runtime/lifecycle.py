"""The one place that builds this process's engine, lazily, and starts it (preloading pinned aliases)."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import uuid
from typing import Any

from django.conf import settings

from mlxhost.engine import Engine, EngineClosedError, EngineConfig

logger = logging.getLogger(__name__)

# Identifies this process's lifetime on every stored response (REG-4).
BOOT_ID = uuid.uuid4().hex

_engine: Engine | None = None

# Shutdown (OPS-5): beyond the drain, how long the workers may take, and how long a view has to
# record its turn after its stream's last event.
STOP_GRACE_S = 5.0
STREAM_SETTLE_S = 0.1


def get_engine() -> Engine:
    """This process's engine, built on first use (never in AppConfig.ready, which runs for migrate too)."""
    global _engine
    if _engine is None:
        if not settings.MLXHOST_RUN_ENGINE:
            raise EngineClosedError("This process does not serve models (MLXHOST_RUN_ENGINE=false).")
        _engine = Engine(engine_config())
    return _engine


def engine_config() -> EngineConfig:
    """The engine's settings from `settings.MLXHOST_ENGINE` (the only place that reads them)."""
    options = settings.MLXHOST_ENGINE
    return EngineConfig(
        backend=options["BACKEND"],
        default_max_tokens=options["DEFAULT_MAX_TOKENS"],
        max_sessions=options.get("MAX_SESSIONS", 8),
        max_session_bytes=options.get("MAX_SESSION_BYTES", 2 << 30),
        session_ttl_s=options.get("SESSION_TTL_S", 1800.0),
        shutdown_timeout_s=options.get("SHUTDOWN_TIMEOUT_S", 10.0),
        housekeeping_interval_s=options.get("HOUSEKEEPING_INTERVAL_S", 30.0),
        memory_budget_bytes=options.get("MEMORY_BUDGET_BYTES") or None,
        burst_wait_s=options.get("BURST_WAIT_MS", 250) / 1000,
        max_request_kv_bytes=options.get("MAX_REQUEST_KV_BYTES"),
        drain_timeout_s=options.get("DRAIN_TIMEOUT_S", 30.0),
    )


def engine_if_started() -> Engine | None:
    """The engine if something already built it; probes use this so they never load models."""
    return _engine


def set_engine(engine: Engine | None) -> None:
    """Swap the process engine (tests install one with a fake backend or a fresh loop)."""
    global _engine
    _engine = engine


async def engine_start() -> None:
    """Start the engine's background work and reconcile it with the database (ADM-3).

    Pinned aliases load now; a failed load is logged and shown in /readyz, not fatal. Control
    messages (alias edits, admin actions) and the status publisher run until shutdown.
    """
    from api import control

    engine = get_engine()
    loop = asyncio.get_running_loop()
    _keep(loop.create_task(engine.housekeeping()))
    _start_persistence(loop)
    actions = control.Actions(engine)
    # A load that found an alias's folder changed registers the new weights (REG-3): the reload
    # action computes the fingerprint again, gets a new instance id and swaps to it.
    engine.on_weights_changed = actions.weights_changed
    _keep(loop.create_task(control.run_control_listener(engine, actions), name="engine-control"))
    _keep(loop.create_task(control.run_status_publisher(engine, actions), name="engine-status"))
    # What is imported by now lives as long as the process: keep it out of the cyclic collector,
    # whose full passes over it stalled the loop for ~100 ms (refusals in a burst, RELIABILITY.md).
    # Before the models load, so an unloaded model's objects stay collectable.
    gc.freeze()
    await control.reconcile(engine, load_pinned=settings.MLXHOST_ENGINE.get("PRELOAD", True))


def _start_persistence(loop: asyncio.AbstractEventLoop) -> None:
    from mlxhost.celery import app
    from models_app.persistence import persistence

    store = persistence()
    # Pending writes and the breaker (PER-4); without a broker there is no beat, so sweep here (PER-5).
    _keep(loop.create_task(store.run_monitor(), name="persist-monitor"))
    if app.conf.task_always_eager:
        _keep(loop.create_task(store.run_sweeper(), name="persist-sweeper"))


_start_tasks: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _start_tasks.add(task)  # keep a reference until done, or the task may be collected
    task.add_done_callback(_start_tasks.discard)


def _start_on_running_loop() -> None:
    _keep(asyncio.get_running_loop().create_task(engine_start()))


def schedule_engine_start() -> None:
    """Called from asgi.py: start the engine once daphne's reactor (and its asyncio loop) runs,
    and drain it before the reactor shuts down (OPS-5).

    Daphne imports the application before it sets its loop as current, so the start is
    deferred with the reactor's `callWhenRunning`. Under other ASGI servers models load on
    their first request instead.
    """
    if "twisted.internet.reactor" not in sys.modules or not settings.MLXHOST_RUN_ENGINE:
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
    reactor.addSystemEventTrigger("before", "shutdown", _drain_before_shutdown)


_stop_task: asyncio.Task[None] | None = None


def _drain_before_shutdown() -> Any:
    from twisted.internet.defer import Deferred

    from api.consumers import pin_open_sockets

    global _stop_task
    if _stop_task is None:
        pin_open_sockets()  # before daphne's own trigger cancels the consumers' tasks
        _stop_task = asyncio.ensure_future(engine_stop())
    return Deferred.fromFuture(_stop_task)


async def engine_stop() -> None:
    """Drain and stop this process's engine, then flush stored responses (OPS-5, LANE-7).

    New requests get 503 `draining`, queued ones too; running streams get SHUTDOWN_TIMEOUT_S
    to finish, then are aborted, and each still ends with its terminal event. Bounded: a wedged
    load or persist is logged and left behind, never waited for without end.
    """
    started = list(_start_tasks)
    for task in started:  # control messages, status, housekeeping: nothing new starts
        task.cancel()
    if started:
        await asyncio.wait(started, timeout=STOP_GRACE_S)
    engine = engine_if_started()
    timeout = engine.config.shutdown_timeout_s if engine else engine_config().shutdown_timeout_s
    if engine is not None:
        logger.info("draining the engine (up to %.0fs)", timeout)
        try:
            await asyncio.wait_for(engine.shutdown(), 2 * timeout + STOP_GRACE_S)
        except TimeoutError:
            logger.error("the engine did not stop in time; exiting anyway")
        except Exception:  # the process exits either way; say why it was not clean
            logger.exception("draining the engine failed")
    try:
        await _flush_persistence(timeout)
    except Exception:
        logger.exception("flushing stored responses failed")
    from api.consumers import close_open_sockets

    if closed := await close_open_sockets(STOP_GRACE_S):
        logger.info("closed %d open WebSocket(s)", closed)
    logger.info("engine stopped")


async def _flush_persistence(timeout: float) -> None:
    from models_app.persistence import persistence_if_started

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    recorded = -1.0
    while loop.time() < deadline:
        # A view records its turn a moment after its stream's last event: settle, then flush.
        await asyncio.sleep(STREAM_SETTLE_S)
        store = persistence_if_started()
        if store is None:
            return
        now_recorded = store.stats()["recorded"]
        flushed = await store.flush(timeout_s=max(0.0, deadline - loop.time()))
        if flushed and now_recorded == recorded:
            await store.aclose()
            return
        recorded = now_recorded
    logger.error("stored responses were still being written at shutdown")
    if (store := persistence_if_started()) is not None:
        await store.aclose()
