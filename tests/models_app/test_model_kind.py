"""A model's kind (API-13): detected from a local folder's files, kept for a hub repo, shown in the admin."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from mlxhost.engine import detect_kind
from models_app.catalogue import specs
from models_app.models import Model
from tests.models_app.test_admin import MODEL_FORM, MODELS_URL
from tests.support import register_alias

if TYPE_CHECKING:
    from pathlib import Path


def folder_with(tmp_path: Path, files: dict[str, object]) -> Path:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return tmp_path


@pytest.mark.parametrize(
    ("files", "kind"),
    [
        pytest.param(
            {"config.json": {"architectures": ["BertModel"]}, "modules.json": []},
            "embedding",
            id="st-modules",
        ),
        pytest.param({"config.json": {}, "1_Pooling/config.json": {}}, "embedding", id="st-pooling"),
        pytest.param(
            {"config.json": {"architectures": ["BertModel"], "model_type": "bert"}},
            "embedding",
            id="bare-bert",
        ),
        pytest.param({"config.json": {"model_type": "xlm-roberta"}}, "embedding", id="encoder-type"),
        pytest.param({"config.json": {"architectures": ["LlamaForCausalLM"]}}, "chat", id="causal-lm"),
        pytest.param(
            {"config.json": {"architectures": ["Qwen2VLForConditionalGeneration"]}}, "chat", id="vlm"
        ),
        pytest.param({"config.json": {"model_type": "llama"}}, "chat", id="no-architectures"),
        pytest.param({}, "chat", id="no-config"),
    ],
)
def test_the_kind_is_read_from_the_folder(tmp_path, files, kind):
    """API-13: sentence-transformers files or a bare encoder mean an embedding model."""
    assert detect_kind(folder_with(tmp_path, files)) == kind


@pytest.mark.django_db
def test_saving_a_local_model_detects_its_kind_and_the_spec_carries_it(minilm_folder, tiny_model_dir):
    """API-13: the demo embedding folder registers as an embedding model, the tiny llama as chat,
    whatever the form said; the engine's spec says so too."""
    minilm = register_alias(name="minilm", folder="all-minilm-l6-v2", kind="chat")
    tiny = register_alias(name="tiny", folder="tiny-llama")
    assert minilm.model.kind == Model.Kind.EMBEDDING
    assert tiny.model.kind == Model.Kind.CHAT
    assert specs.model_spec_for(alias=minilm).kind == "embedding"
    assert specs.model_spec_for(alias=tiny).kind == "chat"


@pytest.mark.django_db
def test_a_hub_model_keeps_the_kind_staff_chose(fake_hub):
    """API-13: a hub repo is not on disk when it is saved; its kind is the staff's choice."""
    from models_app.catalogue import services

    fake_hub.commit("org/embedder", {"config.json": b"{}"})
    alias = services.alias_register(
        name="hub-embed", source_kind="hub", hf_repo="org/embedder", hf_revision="main", kind="embedding"
    )
    assert alias.model.kind == Model.Kind.EMBEDDING


@pytest.mark.django_db
@pytest.mark.usefixtures("no_engine_status")
def test_the_admin_shows_the_kind(admin_client, minilm_folder):
    """API-13: the models list shows each model's kind; the form offers it for hub repos."""
    form = {**MODEL_FORM, "name": "minilm-admin", "local_path": "all-minilm-l6-v2"}
    assert admin_client.post(f"{MODELS_URL}add/", form).status_code == 302
    assert Model.objects.get(name="minilm-admin").kind == Model.Kind.EMBEDDING
    page = admin_client.get(MODELS_URL).content.decode()
    assert "Embedding model" in page
    assert 'name="kind"' in admin_client.get(f"{MODELS_URL}add/").content.decode()
