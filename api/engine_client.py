"""The one place that builds this process's engine, lazily, and starts it (preloading pinned aliases)."""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid

from django.conf import settings

from mlxhost.engine import Engine, EngineConfig

logger = logging.getLogger(__name__)

# Identifies this process's lifetime on every stored response (REG-4).
BOOT_ID = uuid.uuid4().hex

_engine: Engine | None = None


def get_engine() -> Engine:
    """This process's engine, built on first use (never in AppConfig.ready, which runs for migrate too)."""
    global _engine
    if _engine is None:
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
    _keep(loop.create_task(control.run_control_listener(engine, actions), name="engine-control"))
    _keep(loop.create_task(control.run_status_publisher(engine, actions), name="engine-status"))
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
    """Called from asgi.py: start the engine once daphne's reactor (and its asyncio loop) runs.

    Daphne imports the application before it sets its loop as current, so the start is
    deferred with the reactor's `callWhenRunning`. Under other ASGI servers models load on
    their first request instead.
    """
    if "twisted.internet.reactor" not in sys.modules:
        return
    from twisted.internet import reactor

    # callWhenRunning fires as the reactor starts, before asyncio's loop is "running";
    # call_soon defers once more so create_task sees a running loop.
    reactor.callWhenRunning(lambda: asyncio.get_event_loop().call_soon(_start_on_running_loop))
