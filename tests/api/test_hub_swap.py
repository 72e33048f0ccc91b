"""A hub model through the control plane (issue 28), on the real tiny model served by the fake
hub: a moved branch leaves the running instance, its fingerprint and its cached KV alone through
reconciles; Update swaps the alias to a new instance of the new commit, which starts with no KV of
the old one (another disk-tier folder, an empty prefix cache)."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from mlxhost.engine import Message, hub_fingerprint
from mlxhost.engine.backends.mlx.tiny import build_tiny_model
from models_app.catalogue import reconcile as engine_control
from models_app.catalogue import services, specs
from models_app.models import ModelAlias
from models_app.turns import binding, turns
from models_app.turns.turns import TurnRequest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

REPO = "org/tiny"


def folder_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


async def ask(engine, alias_name: str, text: str) -> int:
    """One greedy turn, as the API runs it (a first request binds the name); returns the
    instance that answered."""
    await binding.bind_on_demand(engine, alias_name)
    alias = await sync_to_async(ModelAlias.objects.select_related("model__instance").get)(name=alias_name)
    turn = TurnRequest(alias_name, 1, {"max_tokens": 2}, messages=(Message("user", text),))
    generation = await engine.submit(turns.generation_request(alias, turn, f"r-{text}", engine))
    async for _event in generation.stream():
        pass
    return generation.instance_id


async def test_a_moved_branch_swaps_only_on_update_and_no_old_kv_follows(
    fake_hub, tiny_model_dir, tmp_path, mlx_engine
):
    old_sha = fake_hub.commit(REPO, folder_files(tiny_model_dir))
    alias = await sync_to_async(services.alias_register)(
        name="tiny-hub", source_kind="hub", hf_repo=REPO, hf_revision="main", temperature=0.0
    )
    model = await sync_to_async(lambda: alias.model)()
    await engine_control.reconcile(mlx_engine, load_pinned=False)
    old_id = await ask(mlx_engine, "tiny-hub", "Hello there")
    old = mlx_engine.get(old_id)
    assert old.spec.revision == old_sha and old.spec.fingerprint == hub_fingerprint(REPO, old_sha)
    assert old.sessions.stats.entries >= 1  # KV cached under the old commit

    new_sha = fake_hub.commit(REPO, folder_files(build_tiny_model(tmp_path / "other", seed=1)))
    await engine_control.reconcile(mlx_engine, load_pinned=False)  # the branch moved: nothing changes
    assert await ask(mlx_engine, "tiny-hub", "Hello there") == old_id
    assert mlx_engine.get(old_id).spec.fingerprint == hub_fingerprint(REPO, old_sha)

    update = await sync_to_async(services.model_hub_update)(model=model)
    assert update.moved and "model.safetensors" in update.changes.changed
    await engine_control.reconcile(mlx_engine, load_pinned=False)  # what the listener does on commit
    new_id = await ask(mlx_engine, "tiny-hub", "Hello there")
    new = mlx_engine.get(new_id)
    assert new_id > old_id
    assert (new.spec.revision, new.spec.fingerprint) == (new_sha, hub_fingerprint(REPO, new_sha))
    assert new.model.path.name == new_sha  # the new commit's snapshot is what loaded
    assert new.spec.weights_key != old.spec.weights_key  # the disk tier's folder is another
    assert new.sessions.stats.tokens_saved == 0  # nothing cached under the old commit was reused
    spec = await sync_to_async(specs.model_spec_for)(model=model)
    assert spec.instance_id == new_id
