"""The engine's configuration dataclass; the serving process builds it once from the environment
(`mlxhost.runtime.config`), and its defaults are the only ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend: str = "mlx"  # "mlx" or "fake"
    load_timeout_s: float = 600.0
    shutdown_timeout_s: float = 10.0
    # The prefix cache of each instance (SES-1): entries, bytes and time to live. Bytes None:
    # a quarter of the memory budget, or of the machine's RAM without one (`prefix_cache_bytes`).
    max_sessions: int = 64
    max_session_bytes: int | None = None
    session_ttl_s: float = 1800.0
    # The secret under which cache domains are fingerprinted (SES-3); None: one made at boot.
    # The disk tier only matches after a restart when it is derived from a lasting secret.
    session_secret: bytes | None = None
    # The disk tier (None: off): stored turns' KV caches under this folder, within these bytes.
    kv_dir: str | None = None
    kv_disk_bytes: int = 4 << 30
    # A worker that holds a request this long without a token is reported as stuck (OPS-2).
    stall_after_s: float = 30.0
    # A cancel for an id the engine has not seen yet is remembered this long (LANE-6), unless
    # the id finished within the last `finished_ids_ttl_s` (then the cancel came late, not early).
    early_cancel_ttl_s: float = 60.0
    finished_ids_ttl_s: float = 60.0
    # An admin unload or reload drains the instance (LANE-7): running streams get this long to
    # finish, then they are aborted and end with finish_reason "aborted".
    drain_timeout_s: float = 30.0
    # Keep-alive and the memory budget (OPS-3): how often housekeeping looks for idle instances,
    # and the most bytes resident models may hold (None: no budget).
    housekeeping_interval_s: float = 30.0
    memory_budget_bytes: int | None = None
    # A batch about to start waits at most this long for requests of the same burst that are
    # still loading or templating, so they are prefilled together (0 turns it off).
    burst_wait_s: float = 0.25
    # Speculative decoding in the batch (docs/speculation.md): a batch drafts for the turns
    # whose alias allows it (their own cap on k). False: batches never draft, whatever the alias.
    speculation: bool = True
    # The most KV cache bytes one request may need (prompt + max_tokens); None: what the memory
    # budget, or the machine's RAM without one, leaves beside the model's weights.
    max_request_kv_bytes: int | None = None
    # Unattributed worker failures in a row after which the model is dropped and loaded afresh.
    reload_after_faults: int = 3
    # An embedding pass about to start waits at most this long for concurrent requests still
    # tokenizing, so they share its forward pass (API-14); a lone request never waits.
    embed_wait_s: float = 0.01
    # The most template renders and tokenizations that run at once, all models and surfaces
    # together (`tokenizing.TokenizePool`): each holds a whole prompt and its ids in memory.
    tokenize_threads: int = 4
    # Memory given back at idle (issue 25): once every instance has been idle this long,
    # housekeeping empties MLX's buffer cache and trims glibc's heap (None: never).
    idle_trim_s: float | None = 10.0
    # The most bytes MLX keeps in its cache of freed buffers (None: MLX's own default).
    mlx_cache_limit_bytes: int | None = None


def prefix_cache_bytes(config: EngineConfig, ram_bytes: int | None) -> int:
    """The byte bound of one instance's prefix cache: the setting, else a quarter of the memory
    budget, else a quarter of RAM (2 GiB where the OS does not say)."""
    if config.max_session_bytes is not None:
        return config.max_session_bytes
    basis = config.memory_budget_bytes or ram_bytes
    return basis // 4 if basis else 2 << 30
