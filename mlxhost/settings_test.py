"""Test settings: the same code paths, with tasks run eagerly and the in-memory layers."""

from __future__ import annotations

import os

from mlxhost.engine import EngineConfig
from mlxhost.runtime.config import RuntimeSettings

from .settings import *  # noqa: F403
from .settings import BASE_DIR, DATABASES, REDIS_URL

CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
if not REDIS_URL:
    CELERY_BROKER_URL = "memory://"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast user fixtures
# A persistent, git-ignored cache: the tiny model is built once and reused across runs.
MODELS_ROOT = (BASE_DIR / ".cache" / "test-models").resolve()
MODELS_ROOT.mkdir(parents=True, exist_ok=True)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so a daphne subprocess in the end-to-end tests can share it.
    # One file per pytest process, so concurrent runs never share (and corrupt) one database.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / ".cache" / f"test-db-{os.getpid()}.sqlite3")}
# Usage is flushed when a test says so (`usage.recorder().flush()`), never in the middle of one.
MLXHOST_USAGE_FLUSH_S = 3600.0
# Per-key limit counters of this run only: concurrent runs on one Redis reuse the same key ids.
MLXHOST_LIMITS_PREFIX = f"mlxhost-test-{os.getpid()}:limits"
# The defaults whatever the environment says, the real tiny model, and pinned aliases that wait
# for their first request instead of loading at start.
MLXHOST_RUNTIME = RuntimeSettings(preload=False, engine=EngineConfig(backend="mlx"))
