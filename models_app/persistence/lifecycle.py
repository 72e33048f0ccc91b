"""The write-behind store's part in the lifecycle: its monitor starts with the engine, and what it
still holds is flushed after the drain (PER-4, PER-5, OPS-5). Installed by `mlxhost.composition`."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from mlxhost.celery import app
from mlxhost.runtime import lifecycle
from models_app.persistence.persistence import PERSISTENCE, persistence

if TYPE_CHECKING:
    from mlxhost.engine import Engine

logger = logging.getLogger(__name__)

# A view records its turn a moment after its stream's last event: settle this long, then flush.
STREAM_SETTLE_S = 0.1


def start_persistence(engine: Engine | None = None) -> None:
    """Start the pending-writes monitor and breaker (PER-4); without a broker there is no beat,
    so the sweeper runs here too (PER-5)."""
    store = persistence()
    lifecycle.spawn(store.run_monitor(), name="persist-monitor")
    if app.conf.task_always_eager:
        lifecycle.spawn(store.run_sweeper(), name="persist-sweeper")


async def flush_persistence() -> None:
    """Write what the drained turns left behind, bounded by the shutdown timeout, then close."""
    engine = lifecycle.engine_if_started()
    timeout = (engine.config if engine else lifecycle.runtime_settings().engine).shutdown_timeout_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    recorded = -1.0
    while loop.time() < deadline:
        await asyncio.sleep(STREAM_SETTLE_S)
        store = lifecycle.PROCESS.peek(PERSISTENCE)
        if store is None:
            return
        now_recorded = store.stats()["recorded"]
        flushed = await store.flush(timeout_s=max(0.0, deadline - loop.time()))
        if flushed and now_recorded == recorded:  # nothing new was recorded while it flushed
            await store.aclose()
            return
        recorded = now_recorded
    logger.error("stored responses were still being written at shutdown")
    if (store := lifecycle.PROCESS.peek(PERSISTENCE)) is not None:
        await store.aclose()
