"""Memory given back at idle and MLX's cache bound (issue 25 §4), with the fake backend and clock."""

from __future__ import annotations

import pytest

from mlxhost.engine import memory
from mlxhost.engine.config import EngineConfig
from mlxhost.engine.memory import RSS_SLACK_BYTES, HeapTrimmer
from tests.engine import conftest as engine_support
from tests.engine.conftest import lane_of, until
from tests.engine.test_keepalive import run

IDLE_TRIM_S = 10.0


@pytest.fixture
def trimming(make_engine, fake_clock):
    """An engine on the fake clock whose trims are counted (`released`) and whose RSS is `rss[0]`."""
    released: list[int] = []
    rss = [100 << 20]

    def make(**config):
        engine = make_engine(clock=fake_clock, idle_trim_s=IDLE_TRIM_S, **config)
        engine.trimmer = HeapTrimmer(lambda: released.append(1), rss=lambda: rss[0])
        return engine

    return make, released, rss


async def test_an_idle_engine_trims_once_after_idle_trim_s_and_again_only_after_new_work(
    trimming, fake_clock
):
    """Once every instance has been idle `idle_trim_s`, housekeeping empties the backend's cache
    and glibc's heap, once; a second look without new work does nothing; new work makes it due."""
    make, released, _ = trimming
    engine = make()
    await run(engine)
    fake_clock.advance(IDLE_TRIM_S - 1)
    assert await engine.trim_if_idle() is False
    fake_clock.advance(1)
    assert await engine.trim_if_idle() is True
    assert (released, engine.trimmer.trims, engine.memory()["trims"]) == ([1], 1, 1)
    fake_clock.advance(IDLE_TRIM_S)
    assert await engine.trim_if_idle() is False  # nothing ran since
    await run(engine)
    fake_clock.advance(IDLE_TRIM_S)
    assert await engine.trim_if_idle() is True
    assert released == [1, 1]


async def test_a_busy_engine_never_trims(trimming, fake_clock, backend):
    """A request in the lane (here held on the fake backend's gate) keeps the trim away."""
    from tests.engine.conftest import request, spec

    make, released, _ = trimming
    engine = make()
    backend.gated = True
    generation = await engine.submit(request("held", binding="alias-1", spec_=spec(1), max_tokens=50))
    await until(lambda: lane_of(engine)["active"] == 1, what="the request to run")
    fake_clock.advance(10 * IDLE_TRIM_S)
    assert await engine.trim_if_idle() is False
    assert released == []
    generation.cancel()


async def test_rss_growth_without_engine_work_makes_a_trim_due(trimming, fake_clock):
    """Requests refused before the engine (a huge invalid body) still allocate: RSS grown past
    the slack since the last trim makes the idle engine trim again."""
    make, released, rss = trimming
    engine = make()
    await run(engine)
    fake_clock.advance(IDLE_TRIM_S)
    assert await engine.trim_if_idle() is True
    rss[0] += RSS_SLACK_BYTES // 2
    assert await engine.trim_if_idle() is False
    rss[0] += RSS_SLACK_BYTES
    assert await engine.trim_if_idle() is True
    assert len(released) == 2


async def test_idle_trim_off_never_trims(trimming, fake_clock):
    make, released, _ = trimming
    engine = make()
    engine.config = EngineConfig(backend="fake", idle_trim_s=None)
    await run(engine)
    fake_clock.advance(1e6)
    assert await engine.trim_if_idle() is False
    assert released == []


def test_the_heap_trim_reaches_glibc_here():
    """On this Linux host the trim is glibc's malloc_trim (elsewhere it says it could not)."""
    assert memory.trim_heap() is True
    assert memory.rss_bytes() > 0


async def test_the_cache_limit_from_the_config_reaches_the_backend(backend):
    """`mlx_cache_limit_bytes` is handed to the backend when the engine is built; unset, never."""
    limits: list[int] = []
    backend.set_cache_limit = limits.append  # the MLX backend's hook; the fake has none
    engines = [
        engine_support.TestEngine(
            EngineConfig(backend="fake", mlx_cache_limit_bytes=256 << 20), backend=backend
        ),
        engine_support.TestEngine(EngineConfig(backend="fake"), backend=backend),
    ]
    assert limits == [256 << 20]
    for engine in engines:
        await engine.shutdown()
