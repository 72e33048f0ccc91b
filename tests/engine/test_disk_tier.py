"""The prefix cache's disk tier (SES-9, issue 12): stored turns' KV saved when the worker is idle,
loaded after a restart instead of a replay, scoped, bounded, and never trusted when damaged."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from mlxhost.engine import Message, Started
from mlxhost.engine.disk import KV_SUFFIX, RECORD_SUFFIX, remove_saved, weights_folder
from tests.engine.conftest import collect, lane_idle, request, spec, until

SECRET = b"k" * 32
TURN_1 = (Message("user", "hi"),)
TURN_2 = (*TURN_1, Message("assistant", "Hello"), Message("user", "and more?"))
TURN_1_PROMPT = len("<user>hi<assistant>")
TURN_2_PROMPT = len("<user>hi<assistant>Hello<user>and more?<assistant>")


@pytest.fixture
def kv_dir(tmp_path):
    return tmp_path / "kv"


@pytest.fixture
def boot(make_engine, kv_dir):
    """An engine as one boot of the server: same folder and lasting secret unless told otherwise."""

    def make(**config):
        config.setdefault("kv_dir", str(kv_dir))
        config.setdefault("session_secret", SECRET)
        return make_engine(**config)

    return make


def folder(kv_dir):
    return weights_folder(kv_dir, spec(1).weights_key)


async def turn(engine, request_id, messages, *, keep=True, **query):
    session = engine.scoper.query(tenant="t1", salt="s1", **query)
    generation = await engine.submit(
        dataclasses.replace(
            request(request_id, messages=messages, session=session, max_tokens=50), keep_on_disk=keep
        )
    )
    events = await asyncio.wait_for(collect(generation), 5)
    await lane_idle(engine)
    return generation, events


def cached_of(events) -> int:
    return next(e for e in events if isinstance(e, Started)).cached_tokens


def disk_stats(engine) -> dict:
    return engine.snapshot()[0]["prefix_cache"]["disk"]


async def stored_parent(engine, backend):
    """Turn 1 ("p"), stored: wait until the idle worker saved it."""
    backend.enqueue(["Hello"])
    await turn(engine, "p", TURN_1)
    await until(lambda: disk_stats(engine)["written"] == 1, what="the idle worker to save the stored turn")
    return engine


async def test_a_stored_turn_is_saved_when_the_worker_is_idle(boot, backend, kv_dir):
    """SES-9: a stored turn's KV and its record land under the weights' folder, fingerprints only."""
    engine = await stored_parent(boot(), backend)
    files = sorted(p.name for p in folder(kv_dir).iterdir())
    assert files == [f"p{RECORD_SUFFIX}", f"p{KV_SUFFIX}"]
    record = json.loads((folder(kv_dir) / f"p{RECORD_SUFFIX}").read_text())
    assert record["tokens"] == backend.history[0][1]  # exactly what the cache held: the prompt fed
    assert "s1" not in json.dumps(record)  # fingerprints only (SES-3)
    assert disk_stats(engine)["entries"] == 1


async def test_an_unstored_turn_is_never_saved(boot, backend, kv_dir):
    engine = boot()
    backend.enqueue(["Hello"])
    await turn(engine, "p", TURN_1, keep=False)
    await turn(engine, "q", TURN_2)  # a stored one after it: the worker has run its idle writes
    await until(lambda: disk_stats(engine)["written"] == 1, what="the stored turn's save")
    assert not (folder(kv_dir) / f"p{RECORD_SUFFIX}").exists()
    assert disk_stats(engine)["entries"] == 1


async def test_after_a_restart_a_continuation_loads_its_parent_from_disk(boot, backend):
    """SES-9, SES-7: a new process continues from the saved KV (`disk`), feeding only the new part."""
    first = await stored_parent(boot(), backend)
    await first.shutdown()
    engine = boot()  # a new process: memory is empty
    generation, events = await turn(engine, "c", TURN_2, previous_response_id="p")
    assert generation.session_outcome == "disk"
    assert cached_of(events) == TURN_1_PROMPT
    assert backend.loads_from_disk == 1
    assert len(backend.history[-1][1]) == TURN_2_PROMPT - TURN_1_PROMPT  # only the new part is fed
    assert backend.contexts[-1] == backend.history[0][1]  # penalties still see the whole prompt
    stats = disk_stats(engine)
    assert (stats["hits"], stats["misses"], stats["tokens_saved"]) == (1, 0, TURN_1_PROMPT)


async def test_memory_wins_over_disk_before_a_restart(boot, backend):
    engine = await stored_parent(boot(), backend)
    generation, _ = await turn(engine, "c", TURN_2, previous_response_id="p")
    assert generation.session_outcome == "hit"
    assert backend.loads_from_disk == 0


async def test_another_domain_or_a_boot_secret_never_loads_it(boot, backend):
    first = await stored_parent(boot(), backend)
    await first.shutdown()
    engine = boot()
    generation, events = await turn(engine, "x", TURN_2, previous_response_id="p", instructions="other")
    assert (generation.session_outcome, cached_of(events)) == ("cold_replay", 0)
    await engine.shutdown()
    engine = boot(session_secret=None)  # a secret made at boot: last boot's domains cannot match
    generation, events = await turn(engine, "y", TURN_2, previous_response_id="p")
    assert (generation.session_outcome, cached_of(events)) == ("cold_replay", 0)
    assert backend.loads_from_disk == 0


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "record missing", "kv missing"])
async def test_a_damaged_file_is_ignored_and_deleted(boot, backend, kv_dir, damage):
    """A corrupt or partial file is never used and never fails the request: it goes, the turn replays."""
    first = await stored_parent(boot(), backend)
    await first.shutdown()
    kv, record = folder(kv_dir) / f"p{KV_SUFFIX}", folder(kv_dir) / f"p{RECORD_SUFFIX}"
    data = kv.read_bytes()
    if damage == "flipped byte":
        kv.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    elif damage == "truncated":
        kv.write_bytes(data[: len(data) // 2])
    elif damage == "record missing":
        record.unlink()
    else:
        kv.unlink()
    engine = boot()
    generation, events = await turn(engine, "c", TURN_2, previous_response_id="p")
    assert events[-1].finish_reason == "length"  # served in full (the fake's default script)
    assert (generation.session_outcome, cached_of(events)) == ("cold_replay", 0)
    assert not kv.exists() and not record.exists()
    assert backend.loads_from_disk == 0


async def test_a_file_that_will_not_load_falls_back_to_a_fresh_start(boot, backend, kv_dir):
    """A whole file the backend still cannot read (its record matches) is deleted on the worker."""
    first = await stored_parent(boot(), backend)
    await first.shutdown()
    kv, record_path = folder(kv_dir) / f"p{KV_SUFFIX}", folder(kv_dir) / f"p{RECORD_SUFFIX}"
    kv.write_text("not json")
    record = json.loads(record_path.read_text())
    import zlib

    record.update(size=kv.stat().st_size, crc32=zlib.crc32(kv.read_bytes()))
    record_path.write_text(json.dumps(record))
    engine = boot()
    generation, events = await turn(engine, "c", TURN_2, previous_response_id="p")
    assert events[-1].finish_reason == "length"  # served in full (the fake's default script)
    assert cached_of(events) == 0 and generation.session_outcome == "cold_replay"
    assert not kv.exists() and disk_stats(engine)["discarded"] == 1


async def test_removing_a_response_removes_its_files(boot, backend, kv_dir):
    await stored_parent(boot(), backend)
    assert remove_saved(kv_dir, ["p", "../p", "absent"]) == 2
    assert list(folder(kv_dir).iterdir()) == []


async def test_the_byte_bound_evicts_the_oldest_files(boot, backend, kv_dir, tmp_path):
    """The disk tier stays within its bytes: the least recently used pair goes first."""
    probe = boot(kv_dir=str(tmp_path / "probe"))
    await stored_parent(probe, backend)
    pair = sum(p.stat().st_size for p in weights_folder(tmp_path / "probe", spec(1).weights_key).iterdir())
    engine = boot(kv_disk_bytes=pair + pair // 2)  # one pair fits, two do not
    backend.enqueue(["Hello"])
    await turn(engine, "a", TURN_1)
    await until(lambda: disk_stats(engine)["written"] == 1, what="the first save")
    backend.enqueue(["Hi"])
    await turn(engine, "b", (Message("user", "a different conversation"),))
    # `written` counts the save before the eviction that makes room runs: wait for both.
    await until(
        lambda: disk_stats(engine)["written"] == 2 and disk_stats(engine)["evicted"] == 1,
        what="the second save and the eviction it makes",
    )
    names = sorted(p.name for p in folder(kv_dir).iterdir())
    assert names == [f"b{RECORD_SUFFIX}", f"b{KV_SUFFIX}"]
    assert disk_stats(engine)["evicted"] == 1
