"""The serving process's runtime: the engine's lifecycle, its settings, control and live status.

The API layer gets the engine here (`get_engine()`, `engine_if_started()`); `lifecycle` holds
the start and stop hooks that `persistence`, `control`, `status` and `api.ws.tracking` register.
"""

from __future__ import annotations

from mlxhost.runtime.lifecycle import BOOT_ID, engine_if_started, get_engine, runtime_settings, set_engine

__all__ = ["BOOT_ID", "engine_if_started", "get_engine", "runtime_settings", "set_engine"]
