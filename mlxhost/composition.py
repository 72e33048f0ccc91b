"""The composition root: every start and stop hook of the serving process, listed once.

The one module that may import the API, the use cases and the runtime together (the layers below
never import it; `tests/test_architecture.py`). `mlxhost/asgi.py` installs `HOOKS` on
`mlxhost.runtime.PROCESS` before it schedules the engine's start. Start hooks run in this order once
the server's loop runs; stop hooks run after the drain, by stage and then in this order (OPS-5).
"""

from __future__ import annotations

from api.ws.tracking import close_sockets_at_stop, pin_open_sockets
from mlxhost.runtime.lifecycle import PROCESS, Hooks, Process, StopStage
from models_app.accounting.usage import flush_usage
from models_app.catalogue.live_status import start_status_publisher
from models_app.catalogue.reconcile import start_control
from models_app.persistence.lifecycle import flush_persistence, start_persistence

HOOKS = Hooks(
    start=(
        start_control,  # the control listener, reconcile (pinned models load) and its periodic resync
        start_persistence,  # the write-behind store's monitor and breaker (and its sweeper without a broker)
        start_status_publisher,  # the live status, once a second
    ),
    shutdown_begin=(pin_open_sockets,),  # hold every open socket before daphne cancels its task
    stop=(
        (StopStage.FLUSH, flush_persistence),  # what the drained turns left behind
        (StopStage.FLUSH, flush_usage),  # then the last usage tallies
        (StopStage.CLOSE, close_sockets_at_stop),  # then close the sockets with 1001
    ),
)


def install(process: Process = PROCESS) -> None:
    """Install `HOOKS` on `process` (once, from asgi.py)."""
    process.install(HOOKS)
