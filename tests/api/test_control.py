"""The engine's control plane in process: reconcile, admin actions over the channel layer, status."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache

from mlxhost.engine.backends.mlx.tiny import build_tiny_model
from models_app.catalogue import control, selectors, services, specs
from models_app.catalogue import live_status as engine_status
from models_app.catalogue import reconcile as engine_control
from models_app.models import ModelAlias
from models_app.turns import binding
from tests.api.support import act, capacity_of, save_alias, set_lane, settled
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
    await act(tiny_alias, "load")
    await eventually(lambda: settled(listening, "tiny", "load"), timeout=30)
    instance = mlx_engine.registry.resolve("tiny")
    assert instance.state == "ready"
    assert listening.results["tiny"]["instance_id"] == instance.instance_id

    await act(tiny_alias, "unload")
    await eventually(lambda: instance.state == "unloaded", timeout=30)
    assert listening.results["tiny"]["action"] == "unload"


async def test_loading_a_model_serves_every_enabled_alias_of_it_from_one_lane(
    tiny_alias, mlx_engine, listening
):
    """ADM-1, REG-2, issue 11: one load of the model binds each enabled alias to the same instance;
    a disabled alias of it is not served."""
    other = await sync_to_async(services.alias_register)(
        name="tiny-hot", local_path="tiny-llama", temperature=1.0
    )
    off = await sync_to_async(services.alias_register)(
        name="tiny-off", local_path="tiny-llama", enabled=False
    )
    assert other.model_id == off.model_id == tiny_alias.model_id
    await act(tiny_alias, "load")
    await eventually(lambda: settled(listening, "tiny", "load"), timeout=30)
    assert listening.results["tiny"]["state"] == "done", listening.results
    assert mlx_engine.resolve("tiny") == mlx_engine.resolve("tiny-hot") == tiny_alias.instance_id
    assert not mlx_engine.bound("tiny-off")


async def test_two_aliases_of_one_model_never_change_its_capacity(tiny_alias, api_key, mlx_engine):
    """LANE-1, issue 11: the lane belongs to the model. Requests and token counts through either
    alias, each with its own sampling defaults, leave the capacity where the model sets it."""
    from django.test import AsyncClient

    await set_lane(tiny_alias, concurrency=2)
    await sync_to_async(services.alias_register)(name="tiny-hot", local_path="tiny-llama", temperature=1.0)
    capacities = []
    for name in ("tiny", "tiny-hot", "tiny", "tiny-hot"):
        response = await AsyncClient().post(
            "/v1/messages/count_tokens",
            data=f'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hi"}}]}}',
            content_type="application/json",
            headers={"x-api-key": api_key},
        )
        assert response.status_code == 200, response.content
        capacities.append(capacity_of(mlx_engine, mlx_engine.resolve(name)))
    assert capacities == [2, 2, 2, 2]
    assert mlx_engine.resolve("tiny") == mlx_engine.resolve("tiny-hot")


async def test_a_request_that_read_the_old_row_cannot_undo_a_swap(tiny_alias, reload_folder, mlx_engine):
    """REG-5, issue 11: only control binds. A request holding the alias row from before an admin
    moved the alias to other weights resolves the name to the new binding; the old weights are
    never bound again."""
    from models_app.turns import turns
    from models_app.turns.turns import TurnRequest

    stale = await sync_to_async(selectors.alias_resolve)(name="tiny")  # read before the swap
    old_id = stale.instance_id
    await binding.bind_on_demand(mlx_engine, "tiny")
    assert mlx_engine.resolve("tiny") == old_id
    moved = await sync_to_async(services.alias_register)(name="tiny", local_path="tiny-reload")
    assert moved.instance_id != old_id
    await engine_control.reconcile(mlx_engine, load_pinned=False)  # what the listener does on commit
    assert mlx_engine.resolve("tiny") == moved.instance_id

    # The stale request builds its engine request from the old row and submits it.
    from mlxhost.engine import Message

    turn = TurnRequest("tiny", 1, {"max_tokens": 1}, messages=(Message("user", "Hi"),))
    request = turns.generation_request(stale, turn, "stale", mlx_engine)
    generation = await mlx_engine.submit(request)
    async for _event in generation.stream():
        pass
    assert generation.instance_id == moved.instance_id
    assert mlx_engine.resolve("tiny") == moved.instance_id  # still the new weights
    await binding.bind_on_demand(mlx_engine, "tiny")  # a no-op for a bound name
    assert mlx_engine.resolve("tiny") == moved.instance_id


async def test_alias_edits_reach_the_engine_without_a_request(tiny_alias, mlx_engine, listening):
    """ADM-3, REG-5: a saved edit reconciles the engine: new lane capacity, then unbind on disable."""
    await mlx_engine.load(specs.model_spec_for(alias=tiny_alias), name="tiny")
    instance = mlx_engine.registry.resolve("tiny")
    assert instance.lane.probe().capacity == 1
    await save_alias(tiny_alias, concurrency=3)  # no reconcile here: the listener does it
    await eventually(lambda: instance.lane.probe().capacity == 3, timeout=30)
    await save_alias(tiny_alias, enabled=False)
    await eventually(lambda: "tiny" not in mlx_engine.registry.names(), timeout=30)


async def test_reconcile_loads_pinned_aliases_and_drops_deleted_ones(tiny_alias, mlx_engine):
    """ADM-3, OPS-3: on start the engine loads pinned models' aliases; a deleted alias is unbound."""
    await save_alias(tiny_alias, pinned=True)
    await engine_control.reconcile(mlx_engine)
    assert mlx_engine.registry.resolve("tiny").state == "ready"
    await sync_to_async(services.alias_delete)(alias=tiny_alias)
    await engine_control.reconcile(mlx_engine)
    assert "tiny" not in mlx_engine.registry.names()


async def test_a_deleted_model_leaves_the_engine_and_readyz(tiny_alias, mlx_engine, admin_client):
    """ADM-7, OPS-2: a model loaded with no alias (bound by its instance id), then deleted, is
    unbound and torn down on the next reconcile: no "#N unbound · not loaded" row is left in the
    status the dashboard draws, nor an instance in /readyz."""
    model = await sync_to_async(lambda: tiny_alias.model)()
    spec = await sync_to_async(specs.model_spec_for)(model=model)
    await sync_to_async(services.alias_delete)(alias=tiny_alias)
    await engine_control.reconcile(mlx_engine)
    await mlx_engine.serve([], spec)  # the admin's Load of a model with no alias
    assert [snap["instance_id"] for snap in mlx_engine.snapshot()] == [spec.instance_id]
    await engine_control.reconcile(mlx_engine)  # the model is still there: it stays
    assert [snap["instance_id"] for snap in mlx_engine.snapshot()] == [spec.instance_id]

    await sync_to_async(services.model_delete)(model=model)
    await engine_control.reconcile(mlx_engine)
    assert mlx_engine.snapshot() == [] and mlx_engine.bound_names() == []
    body = (await sync_to_async(admin_client.get)("/readyz")).json()
    assert body["states"] == {} and not body.get("instances")


async def test_a_reload_with_new_weights_swaps_and_a_failed_one_keeps_the_old_instance(
    reload_folder, mlx_engine, listening
):
    """OPS-4, LANE-4: reload loads changed weights beside the old instance, then swaps; a reload
    whose weights fail to load leaves the alias on its previous, still serving, instance."""
    alias = await sync_to_async(register_alias)(name="swappy", folder="tiny-reload", temperature=0.0)
    old_id = alias.instance_id
    await act(alias, "load")
    await eventually(lambda: settled(listening, "swappy", "load"), timeout=30)

    build_tiny_model(reload_folder, seed=1)  # new weights in the same folder
    await act(alias, "reload")
    await eventually(lambda: settled(listening, "swappy", "reload"), timeout=30)
    assert listening.results["swappy"]["state"] == "done", listening.results
    alias = await ModelAlias.objects.select_related("model__instance").aget(pk=alias.pk)
    new_id = alias.instance_id
    assert new_id != old_id
    assert mlx_engine.registry.resolve("swappy").instance_id == new_id
    assert mlx_engine.registry.resolve("swappy").state == "ready"
    assert not [name for name in mlx_engine.bound_names() if name.startswith("reload:")]

    (reload_folder / "model.safetensors").write_bytes(b"not safetensors at all")
    await act(alias, "reload")
    listening.results.pop("swappy")
    await eventually(lambda: settled(listening, "swappy", "reload"), timeout=60)
    assert listening.results["swappy"]["state"] == "failed"
    assert listening.results["swappy"]["error"]
    alias = await ModelAlias.objects.select_related("model").aget(pk=alias.pk)
    assert alias.instance_id == new_id  # the database still points at the working weights
    kept = mlx_engine.registry.resolve("swappy")
    assert (kept.instance_id, kept.state) == (new_id, "ready")


async def test_a_reload_is_in_the_model_history_as_its_requesters(
    reload_folder, mlx_engine, listening, django_user_model
):
    """ADM-6: the reload request and the engine's switch to the new weights are both in the
    model's history, in the name of the staff member who asked."""
    from django.contrib.admin.models import LogEntry

    staff = await django_user_model.objects.acreate(username="reloader", is_staff=True)
    alias = await sync_to_async(register_alias)(name="swappy", folder="tiny-reload", temperature=0.0)
    build_tiny_model(reload_folder, seed=1)  # new weights in the same folder
    await sync_to_async(services.model_request_action)(model=alias.model, action="reload", actor=staff)
    await eventually(lambda: settled(listening, "swappy", "reload"), timeout=30)
    assert listening.results["swappy"]["state"] == "done", listening.results
    new_id = (await ModelAlias.objects.select_related("model").aget(pk=alias.pk)).instance_id
    history = LogEntry.objects.filter(object_id=str(alias.model_id), content_type__model="model")
    assert [
        (entry.user_id, entry.get_change_message()) async for entry in history.order_by("action_time", "pk")
    ] == [(staff.pk, "Requested reload."), (staff.pk, f"Reloaded: now serving instance #{new_id}.")]


async def test_the_status_reports_rates_and_reaches_the_cache(tiny_alias, api_key, mlx_engine):
    """ADM-2, OPS-4: the published status carries live counters and is readable from the cache."""
    from django.test import AsyncClient

    await sync_to_async(cache.delete)(control.STATUS_INDEX_KEY)  # statuses of earlier tests' servers
    actions = engine_control.Actions(mlx_engine)
    builder = engine_status.StatusBuilder(mlx_engine, actions)
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
    assert view["ttft_ms"] > 0 and view["memory_bytes"] > 0
    assert view["load_progress"]["phase"] == "build"  # the last phase the load went through (OPS-4)
    assert 0 <= view["queue_ms"] <= view["ttft_ms"]  # the first-token time includes the queue wait
    assert 1790 <= view["unload_in_s"] <= 1800 and view["unload_label"].startswith("in ")  # OPS-3

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

    from mlxhost import runtime

    settings.MLXHOST_RUNTIME = dataclasses.replace(settings.MLXHOST_RUNTIME, run_engine=False)
    runtime.PROCESS.put(runtime.ENGINE, None)
    response = await AsyncClient().post(
        "/v1/chat/completions",
        data='{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_closed"
    assert runtime.engine_if_started() is None
