"""The Celery app (`celery -A mlxhost.celery worker --beat`); kept out of mlxhost/__init__.py."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mlxhost.settings")

app = Celery("mlxhost")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["models_app"])
