"""LoRA adapters in the admin (issue 28): registered against a base model and checked at save (layer
names, shapes, rank), with the mismatch said on the form; an alias chooses one of its model's adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from django.conf import settings

from mlxhost.engine import adapter_fingerprint
from mlxhost.engine.backends.mlx.tiny import build_random_llama, build_tiny_adapter
from models_app.models import Adapter, ModelAlias
from tests.models_app.test_admin import ALIAS_FORM
from tests.support import register_alias

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

ADD_URL = "/admin/models_app/adapter/add/"


@pytest.fixture(scope="module")
def adapter_folder(tiny_model_dir) -> Path:
    return build_tiny_adapter(tiny_model_dir, Path(settings.MODELS_ROOT) / "adapters" / "admin-one", seed=3)


@pytest.fixture(scope="module")
def narrow_adapter_folder() -> Path:
    """An adapter of another llama (hidden 32, not 64): the same layer names, other shapes."""
    root = Path(settings.MODELS_ROOT)
    narrow = build_random_llama(
        root / "lora-narrow-llama",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return build_tiny_adapter(narrow, root / "adapters" / "narrow-one", seed=4)


@pytest.fixture
def base(tiny_model_dir):
    return register_alias(name="tiny", folder=tiny_model_dir.name, temperature=0.0).model


def relative(folder: Path) -> str:
    return str(folder.relative_to(Path(settings.MODELS_ROOT)))


def post_adapter(admin_client, base, folder: str, name: str = "lora-one"):
    return admin_client.post(
        ADD_URL, {"name": name, "description": "", "base": base.pk, "local_path": folder}
    )


def test_a_fitting_adapter_is_saved_with_what_the_check_found(admin_client, base, adapter_folder):
    response = post_adapter(admin_client, base, relative(adapter_folder))
    assert response.status_code == 302, response.content.decode()[:2000]
    adapter = Adapter.objects.get(name="lora-one")
    assert adapter.fingerprint == adapter_fingerprint(adapter_folder)
    assert (adapter.rank, adapter.scale, adapter.base_id) == (4, 2.0, base.pk)
    assert adapter.layers == 14  # 2 layers x 7 linear layers (mlx-lm's default keys for llama)
    form = admin_client.get(ADD_URL).content.decode()
    assert relative(adapter_folder) in form  # offered among the folders found under MODELS_ROOT


def test_an_adapter_of_other_shapes_is_refused_on_the_form(admin_client, base, narrow_adapter_folder):
    response = post_adapter(admin_client, base, relative(narrow_adapter_folder))
    assert response.status_code == 200
    page = response.content.decode()
    assert "The adapter does not fit the base model" in page
    assert "model.layers.0.mlp.gate_proj: the adapter maps 32 -&gt; 64, the base layer 64 -&gt; 128" in page
    assert "and 9 more." in page  # 14 layers, five shown
    assert not Adapter.objects.exists()


def test_a_rank_that_disagrees_with_its_config_is_refused(admin_client, base, adapter_folder, tmp_path):
    folder = Path(settings.MODELS_ROOT) / "adapters" / "lora-wrong-rank"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(adapter_folder, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (folder / "adapter_config.json").write_text(json.dumps(config))
    page = post_adapter(admin_client, base, relative(folder)).content.decode()
    assert "rank 4, but adapter_config.json says rank 8" in page
    assert not Adapter.objects.exists()


@pytest.mark.parametrize(
    ("folder", "said"),
    [("../etc", "MODELS_ROOT"), ("tiny-llama", "has no adapter_config.json or adapters.safetensors")],
)
def test_a_folder_that_is_no_adapter_is_refused(admin_client, base, folder, said):
    page = post_adapter(admin_client, base, folder).content.decode()
    assert said in page
    assert not Adapter.objects.exists()


def test_an_alias_takes_one_of_its_models_adapters_only(admin_client, base, adapter_folder, tiny_model_dir):
    assert post_adapter(admin_client, base, relative(adapter_folder)).status_code == 302
    adapter = Adapter.objects.get()
    other = register_alias(name="other", folder=relative(build_random_llama(
        Path(settings.MODELS_ROOT) / "lora-narrow-llama", hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    ))).model  # fmt: skip
    url = "/admin/models_app/modelalias/add/"
    refused = admin_client.post(url, {**ALIAS_FORM, "model": other.pk, "adapter": adapter.pk})
    assert refused.status_code == 200
    assert f"The adapter lora-one belongs to {base.name}, not to {other.name}" in refused.content.decode()
    saved = admin_client.post(url, {**ALIAS_FORM, "model": base.pk, "adapter": adapter.pk})
    assert saved.status_code == 302, saved.content.decode()[:2000]
    assert ModelAlias.objects.get(name="tiny-chat").adapter == adapter
    model_page = admin_client.get(f"/admin/models_app/model/{base.pk}/change/").content.decode()
    assert "lora-one" in model_page  # the model's alias list names the adapter
    assert "lora-one" in admin_client.get("/admin/models_app/modelalias/").content.decode()
    adapter_page = admin_client.get(f"/admin/models_app/adapter/{adapter.pk}/change/").content.decode()
    assert "tiny-chat" in adapter_page  # and the adapter's page its aliases
