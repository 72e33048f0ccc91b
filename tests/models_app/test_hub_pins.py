"""Hub models pinned to a commit, in the admin (issue 28), against the local fake hub: saving pins
the commit a revision names, refusals are form errors in words, a moved branch leaves the pin
(and the instance, its fingerprint, its spec) alone until Update, which makes a new instance."""

from __future__ import annotations

import pytest

from mlxhost.engine import hub_fingerprint
from models_app.catalogue import services, specs
from models_app.models import Model, ModelInstance
from tests.models_app.test_admin import MODEL_FORM, MODELS_URL

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

REPO = "org/tiny"
FILES = {"config.json": b"{}", "model.safetensors": b"w" * 1000}
HUB_FORM = {**MODEL_FORM, "name": "tiny-hub", "source_kind": "hub", "local_path": "", "hf_repo": REPO}


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def test_saving_pins_the_commit_and_the_admin_shows_revision_and_commit(admin_client, fake_hub):
    sha = fake_hub.commit(REPO, FILES)
    assert admin_client.post(f"{MODELS_URL}add/", {**HUB_FORM, "hf_revision": "main"}).status_code == 302
    model = Model.objects.select_related("instance").get(name="tiny-hub")
    assert (model.hf_revision, model.hf_sha) == ("main", sha)
    assert (model.instance.source, model.instance.revision) == (REPO, sha)
    assert model.instance.fingerprint == hub_fingerprint(REPO, sha)
    page = admin_client.get(f"{MODELS_URL}{model.pk}/change/").content.decode()
    assert sha in page and 'value="main"' in page
    assert f"{REPO}@main ({sha[:12]})" in admin_client.get(MODELS_URL).content.decode()


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        ("missing", "The hub has no repo org/tiny"),
        ("gated", "org/tiny is gated: accept its conditions on the hub"),
        ("private", "The hub refused access to org/tiny (401)"),
        ("offline", "cannot be reached for org/tiny@main"),
    ],
)
def test_a_hub_refusal_is_a_form_error_in_words_without_the_token(
    admin_client, fake_hub, monkeypatch, setup, words
):
    if setup != "missing":
        fake_hub.commit(REPO, FILES)
    if setup == "gated":
        fake_hub.repos[REPO].gated = True
        monkeypatch.delenv("MLXHOST_HF_TOKEN")
    if setup == "private":
        fake_hub.repos[REPO].private = True
        monkeypatch.setenv("MLXHOST_HF_TOKEN", "hf_not_the_right_token_0000")
    if setup == "offline":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    response = admin_client.post(f"{MODELS_URL}add/", {**HUB_FORM, "hf_revision": "main"})
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == ["hf_repo"]
    assert words in errors["hf_repo"][0]
    page = response.content.decode()
    assert fake_hub.token not in page and "hf_not_the_right_token_0000" not in page
    assert not Model.objects.filter(name="tiny-hub").exists()


def test_a_moved_branch_changes_nothing_until_update(admin_client, fake_hub):
    old_sha = fake_hub.commit(REPO, FILES)
    alias = services.alias_register(name="tiny", source_kind="hub", hf_repo=REPO, hf_revision="main")
    model = alias.model
    old_instance, old_spec = model.instance, specs.model_spec_for(model=model)
    new_sha = fake_hub.commit(REPO, {**FILES, "model.safetensors": b"v" * 1000, "tokenizer.json": b"{}"})

    # An unrelated edit, and a reload, keep the pin: the running instance never sees the new bytes.
    model.concurrency = 2
    services.model_save(model=model)
    assert services.model_fresh_instance(model=model).pk == old_instance.pk
    model.refresh_from_db()
    assert (model.hf_sha, model.instance_id) == (old_sha, old_instance.pk)
    assert specs.model_spec_for(model=model).revision == old_spec.revision == old_sha
    assert specs.model_spec_for(model=model).fingerprint == old_spec.fingerprint

    checked = admin_client.post(
        MODELS_URL, {"action": "check_hub_updates", "_selected_action": [model.pk]}, follow=True
    )
    [said] = messages_of(checked)
    assert f"moved from {old_sha[:12]} to {new_sha[:12]}" in said
    assert "changed model.safetensors" in said and "added tokenizer.json" in said
    model.refresh_from_db()
    assert model.hf_sha == old_sha and model.instance_id == old_instance.pk

    updated = admin_client.post(
        MODELS_URL, {"action": "update_hub_pin", "_selected_action": [model.pk]}, follow=True
    )
    assert "Now instance #" in messages_of(updated)[0]
    model.refresh_from_db()
    spec = specs.model_spec_for(model=model)
    assert model.hf_sha == new_sha and model.instance_id > old_instance.pk
    assert (spec.revision, spec.fingerprint) == (new_sha, hub_fingerprint(REPO, new_sha))
    assert spec.fingerprint != old_spec.fingerprint
    assert ModelInstance.objects.filter(pk=old_instance.pk).exists()  # the old serves until the swap

    again = admin_client.post(
        MODELS_URL, {"action": "check_hub_updates", "_selected_action": [model.pk]}, follow=True
    )
    assert f"still at {new_sha[:12]}; nothing to update" in messages_of(again)[0]


def test_a_revision_that_is_a_commit_never_moves(fake_hub):
    sha = fake_hub.commit(REPO, FILES)
    alias = services.alias_register(name="tiny", source_kind="hub", hf_repo=REPO, hf_revision=sha)
    fake_hub.commit(REPO, {**FILES, "config.json": b"[]"})
    update = services.model_hub_update(model=alias.model)
    assert not update.moved and alias.model.hf_sha == sha
