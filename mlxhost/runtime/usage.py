"""Usage tallies in the lifecycle: what the drained turns tallied is written before the process
exits (KEY-2, OPS-5). Registered on import."""

from __future__ import annotations

from mlxhost.runtime import lifecycle
from models_app.accounting.usage import recorder_if_started


async def flush_usage() -> None:
    """Write the last tallies and stop the flusher (after the stored responses' flush)."""
    store = recorder_if_started()
    if store is not None:
        await store.aclose()


lifecycle.on_stop(flush_usage, stage=lifecycle.StopStage.FLUSH)
