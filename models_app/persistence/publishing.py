"""Getting the persist task to a worker: a fail-fast publisher, and the eager run without a broker."""

from __future__ import annotations

import contextlib
import json
from typing import Any


class CeleryPublisher:
    """Sends the persist task over its own broker connection and fails fast (PER-3).

    Not thread-safe: `Persistence` calls it from one thread. Publishing never retries and every
    socket operation is bounded, so a dead broker costs at most `timeout_s`, then the caller
    writes inline. After a failure the connection is dropped and made again next time.
    """

    def __init__(self, *, timeout_s: float, url: str | None = None, queue: str | None = None) -> None:
        self._timeout_s = timeout_s
        self._url = url
        self._queue = queue
        self._connection: Any = None

    def __call__(self, payload: dict[str, Any]) -> None:
        from models_app.persistence.tasks import response_persist as response_persist_task

        if self._connection is None:
            self._connection = response_persist_task.app.connection_for_write(
                self._url,
                connect_timeout=self._timeout_s,
                transport_options={
                    "max_retries": 0,
                    "socket_connect_timeout": self._timeout_s,
                    "socket_timeout": self._timeout_s,
                },
            )
        try:
            # No transaction is open here (the row is written elsewhere), so there is nothing to
            # wait for: delay_on_commit would fire at once, with retries this path must not take.
            # send_task publishes even where task_always_eager is set: publishing is this class's job.
            response_persist_task.app.send_task(
                response_persist_task.name,
                args=[payload],
                producer=self._connection.Producer(),
                retry=False,
                queue=self._queue,
            )
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


def persist_eagerly(payload: dict[str, Any]) -> None:
    """Run the persist task in this thread, as the embedded default does (no broker)."""
    from models_app.persistence.tasks import response_persist as response_persist_task

    # Round-trip through JSON as a broker would, so a non-primitive payload fails in tests too.
    response_persist_task.apply(args=[json.loads(json.dumps(payload))], throw=True)
