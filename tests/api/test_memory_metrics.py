"""The memory gauges of GET /metrics (issue 25 §4) with the real MLX engine, and MLX's cache limit."""

from __future__ import annotations

import pytest

from tests.api.support import bearer as auth
from tests.api.support import post_chat
from tests.api.test_metrics import scrape

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


async def test_the_memory_gauges_report_rss_mlx_and_the_trims(tiny_alias, api_key, mlx_engine):
    """RSS and MLX's live and cached bytes are what the process holds; a trim at idle is counted
    and empties MLX's cache of freed buffers."""
    assert (await post_chat(api_key, max_tokens=3)).status_code == 200
    before = await scrape(**auth(api_key))
    assert before.get("mlxhost_process_resident_bytes") > 0
    assert before.get("mlxhost_mlx_active_bytes") > 0  # the tiny model's weights at least
    trims = before.get("mlxhost_memory_trims_total")
    mlx_engine.trimmer.trim(last_use=0.0)  # what housekeeping runs at idle
    after = await scrape(**auth(api_key))
    assert after.get("mlxhost_memory_trims_total") == trims + 1
    assert after.get("mlxhost_mlx_cache_bytes") == 0


def test_the_mlx_backend_applies_the_cache_limit():
    """`MLXHOST_MLX_CACHE_LIMIT_BYTES` reaches MLX: the limit read back is the one set."""
    import mlx.core as mx  # noqa: TID251  (a test reads MLX's own state back)

    from mlxhost.engine.backends.mlx.backend import MlxBackend

    previous = mx.set_cache_limit(0)
    try:
        MlxBackend.set_cache_limit(123_456_789)
        assert mx.set_cache_limit(0) == 123_456_789
    finally:
        mx.set_cache_limit(previous)
