"""The serving process's runtime: its settings, its one engine and the lifecycle that starts and stops it.

The layer below the use cases (`models_app`) and above the engine: it knows nothing of the database
or the API. The API layer and the use cases get the engine here (`get_engine()`,
`engine_if_started()`); `PROCESS` holds the process's shared objects and the hooks that the
composition root (`mlxhost.composition`) installs.
"""

from __future__ import annotations

from mlxhost.runtime.lifecycle import (
    BOOT_ID,
    ENGINE,
    PROCESS,
    Shared,
    engine_if_started,
    get_engine,
    runtime_settings,
)

__all__ = ["BOOT_ID", "ENGINE", "PROCESS", "Shared", "engine_if_started", "get_engine", "runtime_settings"]
