"""The disk tier (SES-9) through the Responses API with the real tiny model (issue 12): a stored chain
continues from disk after a restart with the cold replay's text, and a deleted response leaves
no KV file behind."""

from __future__ import annotations

import pytest

from mlxhost import runtime
from mlxhost.engine import Engine, EngineConfig
from tests.api.test_responses import URL, Caller, cached, text_of
from tests.conftest import settle_persistence
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

SECRET = b"d" * 32


@pytest.fixture
def alice(api_key, user) -> Caller:
    return Caller(api_key, user.pk)


@pytest.fixture
def kv_dir(tmp_path, settings):
    settings.MLXHOST_KV_DIR = tmp_path / "kv"
    return tmp_path / "kv"


@pytest.fixture
async def boot(kv_dir):
    """Start an engine as one boot of the server would (the disk tier on, a lasting secret)."""
    engines: list[Engine] = []

    async def make(**config) -> Engine:
        if engines:
            await engines[-1].shutdown()  # the previous boot ends: its memory tier is gone
        config.setdefault("kv_dir", str(kv_dir))
        engine = Engine(EngineConfig(backend="mlx", session_secret=SECRET, **config))
        runtime.PROCESS.put(runtime.ENGINE, engine)
        engines.append(engine)
        return engine

    yield make
    runtime.PROCESS.put(runtime.ENGINE, None)
    for engine in engines:
        await engine.shutdown()
    await settle_persistence()


def disk_of(engine: Engine) -> dict:
    return next(s for s in engine.snapshot() if s["state"] == "ready")["prefix_cache"]["disk"]


async def saved(engine: Engine, count: int) -> None:
    await eventually(lambda: disk_of(engine)["written"] >= count, timeout=30, what="the idle worker's save")


def kv_files(kv_dir) -> list[str]:
    return sorted(p.name for p in kv_dir.rglob("*") if p.is_file())


async def test_after_a_restart_a_chain_continues_from_disk_with_the_cold_replay_text(
    tiny_alias, alice, boot, kv_dir
):
    """Issue 12: the parent's KV loads from disk (`disk`, cached tokens), and the answer is
    exactly the cold replay's (greedy), which runs once the file is gone."""
    engine = await boot()
    first = await alice.clean(input="hello there", instructions="Be brief.")
    second = await alice.clean(input="tell me more", previous_response_id=first["id"])
    await saved(engine, 2)

    engine = await boot()
    warm = await alice.create(input="and then?", previous_response_id=second["id"], max_output_tokens=10)
    assert warm.status_code == 200, warm.content
    assert warm["X-Session-Cache"] == "disk"
    assert cached(warm.json()) > 0
    stats = disk_of(engine)
    assert (stats["hits"], stats["tokens_saved"]) == (1, cached(warm.json()))

    await boot(kv_dir=None)  # the same chain with nothing saved: replayed from the stored rows
    replay = await alice.create(input="and then?", previous_response_id=second["id"], max_output_tokens=10)
    assert replay["X-Session-Cache"] == "cold_replay"
    assert cached(replay.json()) == 0
    assert text_of(replay.json()) == text_of(warm.json())


async def test_deleting_a_stored_response_removes_its_saved_kv(tiny_alias, alice, boot, kv_dir):
    engine = await boot()
    body = await alice.ok(input="hello", max_output_tokens=4)
    await saved(engine, 1)
    assert any(name.startswith(body["id"]) for name in kv_files(kv_dir))
    deleted = await alice.call("delete", f"{URL}/{body['id']}")
    assert deleted.status_code == 200
    assert not any(name.startswith(body["id"]) for name in kv_files(kv_dir))


async def test_an_unstored_response_saves_nothing(tiny_alias, alice, boot, kv_dir):
    engine = await boot()
    await alice.ok(input="hello", max_output_tokens=4, store=False)
    stored = await alice.ok(input="hello again", max_output_tokens=4)
    await saved(engine, 1)
    assert {name.split(".")[0] for name in kv_files(kv_dir)} == {stored["id"]}
