"""A real Celery worker for the integration tests: `python -m tests.integration.celery_worker QUEUE`.

It is the production worker (`mlxhost.celery`, the real task and service) with two test knobs:
redelivery after a lost worker is fast (short visibility timeout, restore sweeps every second),
and every persist prints a trace line, optionally pausing before or after the write so a test
can kill the worker mid-task.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mlxhost.settings")

import django

django.setup()

from mlxhost.celery import app  # noqa: E402
from models_app.catalogue import services  # noqa: E402

DELAY_BEFORE_S = float(os.environ.get("MLXHOST_TEST_PERSIST_DELAY_S", "0"))
DELAY_AFTER_S = float(os.environ.get("MLXHOST_TEST_PERSIST_DELAY_AFTER_S", "0"))
_persist = services.response_persist


def traced_persist(*, payload):
    public_id = payload["public_id"]
    sys.stdout.write(f"PERSIST-START {public_id}\n")
    sys.stdout.flush()
    time.sleep(DELAY_BEFORE_S)  # the thing under test: a slow write (the test sets how slow)
    row = _persist(payload=payload)
    sys.stdout.write(f"PERSIST-WRITTEN {public_id}\n")
    sys.stdout.flush()
    time.sleep(DELAY_AFTER_S)  # the thing under test: a worker slow to ack after writing
    return row


services.response_persist = traced_persist  # the task imports it at call time
app.conf.broker_transport_options = {
    **app.conf.broker_transport_options,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

if __name__ == "__main__":
    queue = sys.argv[1]
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={queue}",
            f"--hostname={queue}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ]
    )
