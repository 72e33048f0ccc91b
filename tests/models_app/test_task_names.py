"""Celery task names are stored in the broker and the beat schedule: a move of the module keeps them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from models_app.catalogue import tasks as catalogue_tasks
from models_app.persistence import tasks

ROOT = Path(__file__).resolve().parents[2]
# What `celery worker` runs before it consumes: Django set up, then the app's autodiscovery; in a
# fresh interpreter, so no test's import of the tasks module hides a discovery that finds nothing.
DISCOVER = (
    "import django, json; django.setup()\n"
    "from mlxhost.celery import app\n"
    "app.loader.import_default_modules()\n"
    "print(json.dumps(sorted(app.tasks)))\n"
)


def test_the_tasks_keep_their_names_after_the_move_to_persistence() -> None:
    assert [tasks.response_persist.name, tasks.responses_purge_expired.name, tasks.tombstones_purge.name] == [
        "models_app.tasks.response_persist",
        "models_app.tasks.responses_purge_expired",
        "models_app.tasks.tombstones_purge",
    ]


def test_the_worker_discovers_every_task_the_beat_schedules() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "mlxhost.settings_test"}
    found = subprocess.run(
        [sys.executable, "-c", DISCOVER],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    discovered = set(json.loads(found.stdout.splitlines()[-1]))
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert scheduled
    assert {*scheduled, tasks.response_persist.name, catalogue_tasks.model_quantize.name} <= discovered
