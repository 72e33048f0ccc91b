"""The engine's control plane in process: reconcile, admin actions over the channel layer, status."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache

from api import control as engine_control
from mlxhost.engine.backends.mlx.tiny import build_tiny_model
from models_app import control, selectors, services
from models_app.models import ModelAlias
from tests.api.support import save_alias, set_lane, settled
from tests.support import eventually, register_alias, watch_group_joins

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
async def listening(mlx_engine, monkeypatch):
    """The engine's control listener running on the test loop (the in-memory channel layer)."""
    actions = engine_control.Actions(mlx_engine)
    joined = watch_group_joins(monkeypatch, get_channel_layer(), control.ENGINE_GROUP)
    task = asyncio.create_task(engine_control.run_control_listener(mlx_engine, actions))
    await asyncio.wait_for(joined.wait(), 10)  # messages sent before it joins would be lost
    yield actions
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
def reload_folder(tiny_model_dir):
    """A tiny model folder of this test's own, so it can be rebuilt or broken."""
    folder = settings.MODELS_ROOT / "tiny-reload"
    shutil.rmtree(folder, ignore_errors=True)
    build_tiny_model(folder, seed=0)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_an_action_sent_on_commit_loads_and_unloads_through_the_writer_path(
    tiny_alias, mlx_engine, listening
):
    """ADM-1, ADM-3: a load request reaches the engine as a channel-layer message; unload frees it."""
    await sync_to_async(services.alias_request_action)(alias=tiny_alias, action="load")
    await eventually(lambda: settled(listening, "tiny", "load"), timeout=30)
    instance = mlx_engine.registry.resolve("tiny")
    assert instance.state == "ready"
    assert listening.results["tiny"]["instance_id"] == instance.instance_id

    await sync_to_async(services.alias_request_action)(alias=tiny_alias, action="unload")
    await eventually(lambda: instance.state == "unloaded", timeout=30)
    assert listening.results["tiny"]["action"] == "unload"


async def test_a_disabled_alias_cannot_be_loaded(tiny_alias):
    """ADM-1: loading needs an enabled alias; the service says why."""
    from django.core.exceptions import ValidationError

    await save_alias(tiny_alias, enabled=False)
    with pytest.raises(ValidationError, match="disabled"):
        await sync_to_async(services.alias_request_action)(alias=tiny_alias, action="load")


async def test_alias_edits_reach_the_engine_without_a_request(tiny_alias, mlx_engine, listening):
    """ADM-3, REG-5: a saved edit reconciles the engine: new lane capacity, then unbind on disable."""
    await mlx_engine.load(selectors.model_spec_for(alias=tiny_alias), name="tiny")
    instance = mlx_engine.registry.resolve("tiny")
    assert instance.lane.probe().capacity == 1
    await set_lane(tiny_alias, concurrency=3)
    await eventually(lambda: instance.lane.probe().capacity == 3, timeout=30)
    await save_alias(tiny_alias, enabled=False)
    await eventually(lambda: "tiny" not in mlx_engine.registry.names(), timeout=30)


async def test_reconcile_loads_pinned_aliases_and_drops_deleted_ones(tiny_alias, mlx_engine):
    """ADM-3, OPS-3: on start the engine loads pinned aliases; a deleted alias is unbound."""
    await save_alias(tiny_alias, pinned=True)
    await engine_control.reconcile(mlx_engine)
    assert mlx_engine.registry.resolve("tiny").state == "ready"
    await sync_to_async(services.alias_delete)(alias=tiny_alias)
    await engine_control.reconcile(mlx_engine)
    assert "tiny" not in mlx_engine.registry.names()


async def test_a_reload_with_new_weights_swaps_and_a_failed_one_keeps_the_old_instance(
    reload_folder, mlx_engine, listening
):
    """OPS-4, LANE-4: reload loads changed weights beside the old instance, then swaps; a reload
    whose weights fail to load leaves the alias on its previous, still serving, instance."""
    alias = await sync_to_async(register_alias)(name="swappy", folder="tiny-reload", temperature=0.0)
    old_id = alias.instance_id
    await sync_to_async(services.alias_request_action)(alias=alias, action="load")
    await eventually(lambda: settled(listening, "swappy", "load"), timeout=30)

    build_tiny_model(reload_folder, seed=1)  # new weights in the same folder
    await sync_to_async(services.alias_request_action)(alias=alias, action="reload")
    await eventually(lambda: settled(listening, "swappy", "reload"), timeout=30)
    assert listening.results["swappy"]["state"] == "done", listening.results
    alias = await ModelAlias.objects.select_related("instance").aget(pk=alias.pk)
    new_id = alias.instance_id
    assert new_id != old_id
    assert mlx_engine.registry.resolve("swappy").instance_id == new_id
    assert mlx_engine.registry.resolve("swappy").state == "ready"
    assert "reload:swappy" not in mlx_engine.registry.names()

    (reload_folder / "model.safetensors").write_bytes(b"not safetensors at all")
    await sync_to_async(services.alias_request_action)(alias=alias, action="reload")
    listening.results.pop("swappy")
    await eventually(lambda: settled(listening, "swappy", "reload"), timeout=60)
    assert listening.results["swappy"]["state"] == "failed"
    assert listening.results["swappy"]["error"]
    alias = await ModelAlias.objects.aget(pk=alias.pk)
    assert alias.instance_id == new_id  # the database still points at the working weights
    kept = mlx_engine.registry.resolve("swappy")
    assert (kept.instance_id, kept.state) == (new_id, "ready")


async def test_the_status_reports_rates_and_reaches_the_cache(tiny_alias, api_key, mlx_engine):
    """ADM-2, OPS-4: the published status carries live counters and is readable from the cache."""
    from django.test import AsyncClient

    await sync_to_async(cache.delete)(control.STATUS_INDEX_KEY)  # statuses of earlier tests' servers
    actions = engine_control.Actions(mlx_engine)
    builder = engine_control.StatusBuilder(mlx_engine, actions)
    response = await AsyncClient().post(
        "/v1/chat/completions",
        data='{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert response.status_code == 200
    first = builder.build()
    view = first["instances"][0]
    assert (view["aliases"], view["state"], view["status"], view["capacity"]) == (["tiny"], "ready", "ok", 1)
    assert view["ttft_ms"] > 0 and view["memory_bytes"] > 0 and view["load_progress"]["done"] > 0

    await AsyncClient().post(
        "/v1/chat/completions",
        data='{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    second = builder.build()
    assert second["instances"][0]["tokens_per_s"] > 0  # seven new tokens since the last build

    await sync_to_async(control.status_publish)(second)
    statuses = await sync_to_async(control.engine_statuses)()
    assert [s["boot_id"] for s in statuses] == [second["boot_id"]]
    views = await sync_to_async(control.instance_views)()
    assert views[view["instance_id"]]["aliases"] == ["tiny"]


async def test_an_admin_only_process_serves_no_models(tiny_alias, api_key, settings):
    """ADM-3: with MLXHOST_RUN_ENGINE=false a process builds no engine; generation answers 503."""
    from django.test import AsyncClient

    from api import engine_client

    settings.MLXHOST_RUN_ENGINE = False
    engine_client.set_engine(None)
    response = await AsyncClient().post(
        "/v1/chat/completions",
        data='{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_closed"
    assert engine_client.engine_if_started() is None
