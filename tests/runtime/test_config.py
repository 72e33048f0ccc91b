"""Runtime settings: parsed once from the environment, with defaults only in the dataclasses."""

from __future__ import annotations

import pytest

from mlxhost.engine import EngineConfig
from mlxhost.runtime.config import RuntimeSettings, runtime_settings_from


def test_an_empty_environment_gives_the_dataclass_defaults():
    assert runtime_settings_from({}) == RuntimeSettings()
    assert runtime_settings_from({}).engine == EngineConfig()


def test_each_variable_reaches_its_field():
    settings = runtime_settings_from(
        {
            "MLXHOST_RUN_ENGINE": "false",
            "MLXHOST_PRELOAD": "no",
            "MLXHOST_ENGINE_BACKEND": "fake",
            "MLXHOST_MAX_SESSIONS": "3",
            "MLXHOST_MAX_SESSION_BYTES": "1024",
            "MLXHOST_SESSION_TTL_S": "9.5",
            "MLXHOST_SHUTDOWN_TIMEOUT_S": "4",
            "MLXHOST_DRAIN_TIMEOUT_S": "6",
            "MLXHOST_HOUSEKEEPING_INTERVAL_S": "2",
            "MLXHOST_MEMORY_BUDGET_BYTES": "4096",
            "MLXHOST_BURST_WAIT_MS": "50",
            "MLXHOST_MAX_REQUEST_KV_BYTES": "2048",
        }
    )
    assert (settings.run_engine, settings.preload) == (False, False)
    assert settings.engine == EngineConfig(
        backend="fake",
        max_sessions=3,
        max_session_bytes=1024,
        session_ttl_s=9.5,
        shutdown_timeout_s=4.0,
        drain_timeout_s=6.0,
        housekeeping_interval_s=2.0,
        memory_budget_bytes=4096,
        burst_wait_s=0.05,
        max_request_kv_bytes=2048,
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("0", None, id="zero-is-no-limit"),
        pytest.param("", None, id="empty-is-unset"),
        pytest.param("10", 10, id="a-limit"),
    ],
)
def test_byte_limits_treat_zero_as_none(raw, expected):
    assert runtime_settings_from({"MLXHOST_MEMORY_BUDGET_BYTES": raw}).engine.memory_budget_bytes == expected


def test_the_settings_are_frozen():
    settings = runtime_settings_from({})
    with pytest.raises(AttributeError):
        settings.preload = False  # type: ignore[misc]


def test_the_dead_default_max_tokens_setting_is_gone():
    """Issue 11: MLXHOST_DEFAULT_MAX_TOKENS set nothing (the alias's max_tokens decides); it is removed."""
    assert not hasattr(EngineConfig(), "default_max_tokens")


@pytest.mark.parametrize(
    ("env", "trim_s", "cache_limit"),
    [
        pytest.param({}, EngineConfig().idle_trim_s, None, id="defaults"),
        pytest.param({"MLXHOST_IDLE_TRIM_S": "3", "MLXHOST_MLX_CACHE_LIMIT_BYTES": "0"}, 3.0, 0, id="set"),
        pytest.param(
            {"MLXHOST_IDLE_TRIM_S": "off", "MLXHOST_MLX_CACHE_LIMIT_BYTES": "268435456"},
            None,
            1 << 28,
            id="off",
        ),
    ],
)
def test_the_memory_settings_reach_the_engine(env, trim_s, cache_limit):
    """Issue 25: the idle trim ("off" turns it off) and MLX's cache limit (0 is a limit: no cache)."""
    engine = runtime_settings_from(env).engine
    assert (engine.idle_trim_s, engine.mlx_cache_limit_bytes) == (trim_s, cache_limit)
