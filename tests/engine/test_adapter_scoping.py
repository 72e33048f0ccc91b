"""KV is keyed by adapter (issue 28): a LoRA adapter's fingerprint is part of the cache domain, so KV
computed under one adapter is never reused under another adapter or the base, neither from memory
(prefix, cache key, warm slot, parent id) nor from the disk tier after a restart; under its own
adapter it is. The fake backend records which adapter each generation ran under."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from mlxhost.engine import AdapterRef, SessionScoper
from tests.engine.conftest import collect, lane_idle, request, until
from tests.engine.test_disk_tier import SECRET, TURN_1, TURN_1_PROMPT, TURN_2, cached_of, disk_stats

ONE = AdapterRef("1" * 64, "one", "/adapters/one")
TWO = AdapterRef("2" * 64, "two", "/adapters/two")


@pytest.fixture
def boot(make_engine, tmp_path):
    def make(**config):
        config.setdefault("kv_dir", str(tmp_path / "kv"))
        config.setdefault("session_secret", SECRET)
        return make_engine(**config)

    return make


async def turn(engine, request_id, messages, adapter: AdapterRef | None, **query):
    """A stored turn of tenant t1 under `adapter` (None: the base), scoped as models_app scopes it."""
    session = engine.scoper.query(tenant="t1", salt="s1", adapter=adapter.key if adapter else "", **query)
    body = request(request_id, messages=messages, session=session, max_tokens=50)
    generation = await engine.submit(dataclasses.replace(body, keep_on_disk=True, adapter=adapter))
    events = await asyncio.wait_for(collect(generation), 5)
    await lane_idle(engine)
    return generation, events


def test_the_adapter_is_part_of_the_domain():
    scoper = SessionScoper(SECRET)
    domains = {scoper.query(tenant="t1", salt="s", adapter=a).domain for a in ("", ONE.key, TWO.key)}
    assert len(domains) == 3
    assert (
        scoper.query(tenant="t1", salt="s").domain == scoper.query(tenant="t1", salt="s", adapter="").domain
    )


@pytest.mark.parametrize("query", [{}, {"prompt_cache_key": "k"}, {"warm_any": True}])
async def test_memory_kv_is_reused_under_its_own_adapter_only(boot, backend, query):
    engine = boot()
    backend.enqueue(["Hello"])
    await turn(engine, "p", TURN_1, ONE, **query)
    for other in (TWO, None):
        _, events = await turn(engine, f"x-{other.name if other else 'base'}", TURN_2, other, **query)
        assert cached_of(events) == 0, other
    _, events = await turn(engine, "c", TURN_2, ONE, **query)
    assert cached_of(events) == TURN_1_PROMPT
    assert backend.adapters == ["one", "two", None, "one"]  # each ran under its own adapter


async def test_a_parent_id_under_another_adapter_replays_cold(boot, backend):
    engine = boot()
    backend.enqueue(["Hello"])
    await turn(engine, "p", TURN_1, ONE)
    generation, events = await turn(engine, "c", TURN_2, TWO, previous_response_id="p")
    assert (generation.session_outcome, cached_of(events)) == ("cold_replay", 0)


async def test_the_disk_tier_never_loads_another_adapters_kv(boot, backend):
    """After a restart the saved parent loads under its adapter, never under another or the base."""
    first = boot()
    backend.enqueue(["Hello"])
    await turn(first, "p", TURN_1, ONE)
    await until(lambda: disk_stats(first)["written"] == 1, what="the stored turn's save")
    await first.shutdown()
    engine = boot()
    for name, other in (("x", TWO), ("y", None)):
        generation, events = await turn(engine, name, TURN_2, other, previous_response_id="p")
        assert (generation.session_outcome, cached_of(events)) == ("cold_replay", 0)
    assert backend.loads_from_disk == 0
    generation, events = await turn(engine, "c", TURN_2, ONE, previous_response_id="p")
    assert (generation.session_outcome, cached_of(events)) == ("disk", TURN_1_PROMPT)
