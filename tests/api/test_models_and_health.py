"""GET /v1/models and the health probes."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
from django.test import AsyncClient

from tests.support import register_alias

pytestmark = [pytest.mark.django_db(transaction=True)]

URL_CHAT = "/v1/chat/completions"


async def test_models_lists_enabled_aliases_in_openai_shape(tiny_alias, api_key):
    """REG-8: enabled aliases, OpenAI list shape, with load state."""

    await services_call(register_alias, name="hidden", folder="tiny-llama", enabled=False)
    response = await AsyncClient().get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    model = body["data"][0]
    assert model["object"] == "model"
    assert model["owned_by"] == "mlxhost"
    assert model["state"] == "unloaded"
    assert model["instance_id"] == tiny_alias.instance_id


async def test_models_reports_ready_after_a_request(tiny_alias, api_key, mlx_engine):
    headers = {"Authorization": f"Bearer {api_key}"}
    client = AsyncClient()
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    await client.post("/v1/chat/completions", data=body, content_type="application/json", headers=headers)
    response = await client.get("/v1/models/tiny", headers=headers)
    assert response.json()["state"] == "ready"


async def test_models_needs_a_key():
    assert (await AsyncClient().get("/v1/models")).status_code == 401


async def test_healthz_is_public_and_minimal():
    """OPS-2 (healthz) and API-5's allowlist: the liveness probe needs no key and says nothing more."""
    response = await AsyncClient().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_lists_instances_with_lane_counters_for_key_holders(tiny_alias, api_key, mlx_engine):
    """OPS-2, LANE-9: per-instance state and lane counters, for callers with a key."""
    from models_app.catalogue import specs

    spec = await services_call(specs.model_spec_for, alias=tiny_alias)
    await mlx_engine.load(spec, name="tiny")
    response = await AsyncClient().get("/readyz", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 200
    [instance] = response.json()["instances"]
    assert instance["aliases"] == ["tiny"]
    assert instance["status"] == "ok"
    assert instance["memory_bytes"] > 0
    assert instance["lane"] == {
        "active": 0,
        "queued": 0,
        "permits": 0,
        "writers": 0,
        "capacity": 1,
        "limit": 17,
        "saturated": False,
        "draining": False,
    }


async def test_readyz_without_credentials_says_only_the_status(tiny_alias, mlx_engine):
    """OPS-2: an anonymous probe learns ready or not and how many models are in each state, never
    which models, instances or counters."""
    from models_app.catalogue import specs

    await mlx_engine.load(await services_call(specs.model_spec_for, alias=tiny_alias), name="tiny")
    response = await AsyncClient().get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "states": {"ok": 1}}  # how many, never which
    bad = await AsyncClient().get("/readyz", headers={"Authorization": "Bearer mlxh_nope"})
    assert "instances" not in bad.json() and "models" not in bad.json()


async def services_call(fn, **kwargs):
    from asgiref.sync import sync_to_async

    return await sync_to_async(fn)(**kwargs)


async def test_readyz_says_degraded_after_an_unattributed_failure_until_a_clean_turn(
    tiny_alias, api_key, mlx_engine, monkeypatch
):
    """OPS-2: a worker failure nobody can be blamed for shows as `degraded` in /readyz (still 200: the host serves), and the next clean generation clears it."""
    from mlxhost.engine.backends.mlx.backend import MlxModel

    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (
        await AsyncClient().post(URL_CHAT, json.dumps(body), "application/json", headers=headers)
    ).status_code == 200

    def broken(self, *args, **kwargs):
        raise RuntimeError("a kernel failed")
        yield  # pragma: no cover

    monkeypatch.setattr(MlxModel, "generate", broken)
    failed = await AsyncClient().post(URL_CHAT, json.dumps(body), "application/json", headers=headers)
    assert failed.status_code == 500 and b"kernel" not in failed.content
    ready = await AsyncClient().get("/readyz", headers=headers)
    assert ready.status_code == 200
    assert ready.json()["status"] == "degraded"
    (instance,) = ready.json()["instances"]
    assert instance["status"] == "degraded" and instance["faults"]["in_a_row"] == 1
    monkeypatch.undo()
    assert (
        await AsyncClient().post(URL_CHAT, json.dumps(body), "application/json", headers=headers)
    ).status_code == 200
    assert (await AsyncClient().get("/readyz", headers=headers)).json()["status"] == "ok"


@pytest.fixture
def broken_alias(tiny_model_dir, settings):
    """An alias whose weights were registered whole and then broke (the load fails)."""
    folder = settings.MODELS_ROOT / "tiny-broken"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(tiny_model_dir, folder)
    alias = register_alias(name="broken", folder="tiny-broken")
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")
    yield alias
    shutil.rmtree(folder, ignore_errors=True)


async def load_both(mlx_engine, *aliases) -> None:
    """Load each alias's model; a failing load leaves its instance in `error`."""
    from mlxhost.engine import EngineError
    from models_app.catalogue import specs

    for alias in aliases:
        spec = await services_call(specs.model_spec_for, alias=alias)
        with contextlib.suppress(EngineError):
            await mlx_engine.load(spec, name=alias.name)


async def test_readyz_stays_ready_while_one_model_of_two_serves(
    tiny_alias, broken_alias, api_key, mlx_engine
):
    """OPS-2: one failed model does not take a host that serves another out of its load
    balancer: 200, `degraded`, and each model's state in the body."""
    await load_both(mlx_engine, tiny_alias, broken_alias)
    response = await AsyncClient().get("/readyz", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["states"]) == ("degraded", {"ok": 1, "error": 1})
    assert [(m["model"], m["aliases"], m["state"]) for m in body["models"]] == [
        ("broken", ["broken"], "error"),
        ("tiny", ["tiny"], "ok"),
    ]
    assert {m["instance_id"] for m in body["models"]} == {tiny_alias.instance_id, broken_alias.instance_id}
    anonymous = await AsyncClient().get("/readyz")
    assert (anonymous.status_code, anonymous.json()) == (
        200,
        {"status": "degraded", "states": {"ok": 1, "error": 1}},
    )


async def test_readyz_is_503_when_no_model_can_serve(broken_alias, api_key, mlx_engine):
    """OPS-2: with every model failed, the host is out of the balancer (503 `unavailable`)."""
    await load_both(mlx_engine, broken_alias)
    response = await AsyncClient().get("/readyz", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert [m["state"] for m in response.json()["models"]] == ["error"]


async def test_readyz_with_nothing_to_load_is_ready(mlx_engine):
    """OPS-2: a host with no model (yet) is ready: there is nothing it waits for."""
    response = await AsyncClient().get("/readyz")
    assert (response.status_code, response.json()) == (200, {"status": "ok", "states": {}})


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        pytest.param([], (True, "ok"), id="no-models"),
        pytest.param(["ok", "unloaded"], (True, "ok"), id="all-fine"),
        pytest.param(["unloaded"], (True, "ok"), id="loads-on-demand"),
        pytest.param(["ok", "loading"], (True, "degraded"), id="one-loading"),
        pytest.param(["error", "unloaded"], (True, "degraded"), id="failed-and-on-demand"),
        pytest.param(["degraded"], (True, "degraded"), id="saturated-still-serves"),
        pytest.param(["loading"], (False, "unavailable"), id="only-loading"),
        pytest.param(["reloading"], (True, "degraded"), id="only-reloading-requests-wait"),
        pytest.param(["error", "loading"], (False, "unavailable"), id="none-can-serve"),
    ],
)
def test_readiness_needs_one_model_that_can_serve(states, expected):
    """OPS-2: the readiness rule, state by state."""
    from api.health import readiness

    models = [{"model": f"m{i}", "state": state} for i, state in enumerate(states)]
    assert readiness(models, started=True) == expected
    assert readiness(models, started=False) == (False, "starting")
