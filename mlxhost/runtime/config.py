"""The serving process's runtime settings: `MLXHOST_*` variables parsed once into frozen dataclasses.

The defaults live here (and in `EngineConfig`) and nowhere else. `mlxhost/settings.py` calls
`runtime_settings_from(os.environ)` once, after it has read `.env`, and keeps the result as
`settings.MLXHOST_RUNTIME`; code reads it through `runtime_settings()`. Tests swap it with
`dataclasses.replace` on the pytest-django `settings` fixture. Pure Python: no Django import.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine import EngineConfig

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

# django-environ's truthy words, so these variables parse like every other setting.
TRUE_WORDS = frozenset({"true", "on", "ok", "y", "yes", "1"})


@dataclass(frozen=True, slots=True)
class PersistenceSettings:
    """Stored responses (PER-1..5): the web process publishes the persist task with a bounded
    timeout and writes inline when the broker is down; a persist still pending after the hard
    timeout trips the breaker (instance retention released, tombstone recorded)."""

    publish_timeout_s: float = 2.0  # publishing one persist task to the broker
    hard_timeout_s: float = 60.0  # a write still pending this long trips the breaker
    wait_s: float = 10.0  # a read of a response still being written waits this long (PER-2)
    poll_s: float = 0.25  # and looks for its row this often
    tombstone_ttl_s: float = 2 * 3600.0  # a breaker tombstone waits this long for its late row
    # Without a broker (embedded default) the web process runs the periodic cleanups itself.
    sweep_interval_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """What the serving process needs beyond the engine's own configuration."""

    # False for a process that only serves the admin and dashboard: no engine, no model, and the
    # generation endpoints answer 503 (another process's engine serves them, ADM-3).
    run_engine: bool = True
    # Load pinned models when the server starts (ADM-3).
    preload: bool = True
    # Reconcile with the database this often even without a `models.changed` message, so an
    # edit made where no channel layer reaches this process (a shell, a second process without
    # Redis) still applies: only control binds names (REG-5). 0 turns it off.
    reconcile_interval_s: float = 5.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    persistence: PersistenceSettings = field(default_factory=PersistenceSettings)


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    return default if raw is None else raw.strip().lower() in TRUE_WORDS


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    return float(raw) if raw else default


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    return int(raw) if raw else default


def _limit(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name, 0) or None  # unset or 0: no limit


def _bytes_or_default(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    return int(raw) if raw else None  # unset: the library's own default; 0 is a value


def _idle_trim(env: Mapping[str, str], default: float | None) -> float | None:
    raw = env.get("MLXHOST_IDLE_TRIM_S", "").strip().lower()
    if not raw:
        return default
    return None if raw == "off" else float(raw)


def engine_config_from(
    env: Mapping[str, str], *, kv_dir: Path | None = None, secret_key: str = ""
) -> EngineConfig:
    """An `EngineConfig` from `MLXHOST_*` variables; each one unset keeps the dataclass default.

    `kv_dir` is the disk tier's default folder (`MLXHOST_KV_DIR` wins; `MLXHOST_KV_DISK_BYTES` 0
    turns it off); cache domains are fingerprinted under a secret derived from `secret_key`, so
    the disk tier still matches after a restart (none given: a secret made at boot).
    """
    base = EngineConfig()
    folder = env.get("MLXHOST_KV_DIR", "").strip() or (str(kv_dir) if kv_dir is not None else None)
    secret = hmac.new(secret_key.encode(), b"mlxhost cache domains", hashlib.sha256).digest()
    return EngineConfig(
        session_secret=secret if secret_key else None,
        kv_dir=folder,
        kv_disk_bytes=_int(env, "MLXHOST_KV_DISK_BYTES", base.kv_disk_bytes),
        backend=env.get("MLXHOST_ENGINE_BACKEND", "").strip() or base.backend,
        max_sessions=_int(env, "MLXHOST_MAX_SESSIONS", base.max_sessions),
        max_session_bytes=_limit(env, "MLXHOST_MAX_SESSION_BYTES"),
        session_ttl_s=_float(env, "MLXHOST_SESSION_TTL_S", base.session_ttl_s),
        shutdown_timeout_s=_float(env, "MLXHOST_SHUTDOWN_TIMEOUT_S", base.shutdown_timeout_s),
        drain_timeout_s=_float(env, "MLXHOST_DRAIN_TIMEOUT_S", base.drain_timeout_s),
        housekeeping_interval_s=_float(env, "MLXHOST_HOUSEKEEPING_INTERVAL_S", base.housekeeping_interval_s),
        memory_budget_bytes=_limit(env, "MLXHOST_MEMORY_BUDGET_BYTES"),
        burst_wait_s=_float(env, "MLXHOST_BURST_WAIT_MS", base.burst_wait_s * 1000) / 1000,
        speculation=_bool(env, "MLXHOST_SPECULATION", base.speculation),
        max_request_kv_bytes=_limit(env, "MLXHOST_MAX_REQUEST_KV_BYTES"),
        tokenize_threads=max(1, _int(env, "MLXHOST_TOKENIZE_THREADS", base.tokenize_threads)),
        idle_trim_s=_idle_trim(env, base.idle_trim_s),
        mlx_cache_limit_bytes=_bytes_or_default(env, "MLXHOST_MLX_CACHE_LIMIT_BYTES"),
    )


def persistence_settings_from(env: Mapping[str, str]) -> PersistenceSettings:
    """`PersistenceSettings` from `MLXHOST_PERSIST_*`, `MLXHOST_TOMBSTONE_TTL_S` and
    `MLXHOST_SWEEP_INTERVAL_S`; each one unset keeps the dataclass default."""
    base = PersistenceSettings()
    return PersistenceSettings(
        publish_timeout_s=_float(env, "MLXHOST_PERSIST_PUBLISH_TIMEOUT_S", base.publish_timeout_s),
        hard_timeout_s=_float(env, "MLXHOST_PERSIST_HARD_TIMEOUT_S", base.hard_timeout_s),
        wait_s=_float(env, "MLXHOST_PERSIST_WAIT_S", base.wait_s),
        poll_s=_float(env, "MLXHOST_PERSIST_POLL_S", base.poll_s),
        tombstone_ttl_s=_float(env, "MLXHOST_TOMBSTONE_TTL_S", base.tombstone_ttl_s),
        sweep_interval_s=_float(env, "MLXHOST_SWEEP_INTERVAL_S", base.sweep_interval_s),
    )


def runtime_settings_from(
    env: Mapping[str, str], *, kv_dir: Path | None = None, secret_key: str = ""
) -> RuntimeSettings:
    """`RuntimeSettings` from `env` (the process environment, or a test's mapping); see
    `engine_config_from` for `kv_dir` and `secret_key`."""
    base = RuntimeSettings()
    return RuntimeSettings(
        run_engine=_bool(env, "MLXHOST_RUN_ENGINE", base.run_engine),
        preload=_bool(env, "MLXHOST_PRELOAD", base.preload),
        reconcile_interval_s=_float(env, "MLXHOST_RECONCILE_INTERVAL_S", base.reconcile_interval_s),
        engine=engine_config_from(env, kv_dir=kv_dir, secret_key=secret_key),
        persistence=persistence_settings_from(env),
    )
