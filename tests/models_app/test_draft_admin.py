"""A model's draft model in the admin (issue 27): saved with a vocabulary check, part of the
instance's identity, and handed to the engine in the model's spec."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from mlxhost.engine import folder_fingerprint, with_draft
from models_app.catalogue import services
from models_app.catalogue.specs import model_spec_for
from models_app.models import Model
from tests.models_app.test_admin import MODEL_FORM, MODELS_URL

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]


def add_model(admin_client, name: str, folder: str, **fields: object):
    return admin_client.post(
        f"{MODELS_URL}add/", {**MODEL_FORM, "name": name, "local_path": folder, **fields}
    )


def test_a_draft_with_the_same_vocabulary_is_saved_and_reaches_the_spec(
    admin_client, tiny_model_dir, tiny_model_b_dir
):
    response = add_model(admin_client, "tiny-draft", "tiny-llama-b")
    assert response.status_code == 302, response.content.decode()[:2000]
    draft = Model.objects.get(name="tiny-draft")
    response = add_model(admin_client, "tiny-target", "tiny-llama", draft_model=str(draft.pk))
    assert response.status_code == 302, response.content.decode()[:2000]
    target = Model.objects.get(name="tiny-target")
    assert target.draft_model == draft
    assert draft.instance is not None and target.instance is not None
    # The draft is part of the identity: the target's instance is not its bare folder's.
    own = folder_fingerprint(tiny_model_dir)
    assert target.instance.fingerprint == with_draft(own, draft.instance.fingerprint) != own
    spec = model_spec_for(model=target)
    assert spec.draft is not None and spec.draft.source == str(tiny_model_b_dir.resolve())
    assert spec.draft.fingerprint == draft.instance.fingerprint
    assert model_spec_for(model=draft).draft is None

    # Without the draft, other weights: another instance id.
    before = target.instance_id
    change = {**MODEL_FORM, "name": "tiny-target", "local_path": "tiny-llama", "draft_model": ""}
    response = admin_client.post(f"{MODELS_URL}{target.pk}/change/", change)
    assert response.status_code == 302, response.content.decode()[:2000]
    target.refresh_from_db()
    assert target.draft_model is None and target.instance_id != before
    assert target.instance is not None and target.instance.fingerprint == own


def test_a_draft_with_another_vocabulary_is_a_form_error(admin_client, tiny_model_dir, tiny_tools_model_dir):
    """The tools variant's tokenizer has other tokens: the page says so on the field, no 500."""
    response = add_model(admin_client, "tiny-tools", "tiny-llama-tools")
    assert response.status_code == 302, response.content.decode()[:2000]
    draft = Model.objects.get(name="tiny-tools")
    response = add_model(admin_client, "tiny-target", "tiny-llama", draft_model=str(draft.pk))
    assert response.status_code == 200
    page = response.content.decode()
    assert "a draft must use the same tokenizer" in page
    assert not Model.objects.filter(name="tiny-target").exists()


def test_a_draft_cannot_have_a_draft_nor_be_its_own(admin_client, tiny_model_dir, tiny_model_b_dir):
    assert add_model(admin_client, "tiny-draft", "tiny-llama-b").status_code == 302
    draft = Model.objects.get(name="tiny-draft")
    assert add_model(admin_client, "tiny-target", "tiny-llama", draft_model=str(draft.pk)).status_code == 302
    target = Model.objects.get(name="tiny-target")
    # The draft now naming the target: a chain, refused in words.
    change = {**MODEL_FORM, "name": "tiny-draft", "local_path": "tiny-llama-b", "draft_model": str(target.pk)}
    response = admin_client.post(f"{MODELS_URL}{draft.pk}/change/", change)
    assert response.status_code == 200
    assert "a draft model cannot have one" in response.content.decode()
    # Itself is not among the choices.
    change = {**MODEL_FORM, "name": "tiny-target", "local_path": "tiny-llama", "draft_model": str(target.pk)}
    response = admin_client.post(f"{MODELS_URL}{target.pk}/change/", change)
    assert response.status_code == 200
    assert "Select a valid choice" in response.content.decode()
    # Nor is a draft deleted from under its model.
    with pytest.raises(ValidationError, match="is the draft model of tiny-target"):
        services.model_delete(model=draft)


def test_the_spec_with_its_draft_needs_no_query_past_the_lookup(
    admin_client, tiny_model_dir, tiny_model_b_dir, django_assert_num_queries
):
    """Control builds specs on the event loop (reconcile's actions): the lookups fetch the draft
    and its instance with the model, so building the spec reads nothing lazily (which async code
    may not do)."""
    from models_app.catalogue import reconcile, selectors
    from models_app.models import ModelAlias

    assert add_model(admin_client, "tiny-draft", "tiny-llama-b").status_code == 302
    draft = Model.objects.get(name="tiny-draft")
    assert add_model(admin_client, "tiny-target", "tiny-llama", draft_model=str(draft.pk)).status_code == 302
    ModelAlias.objects.create(name="tiny-drafted", model=Model.objects.get(name="tiny-target"))
    looked_up = [
        reconcile._model_named("tiny-target"),
        selectors.alias_resolve(name="tiny-drafted").model,
        *(m for m in selectors.models_served() if m.name == "tiny-target"),
        *(a.model for a in selectors.aliases_enabled()),
    ]
    with django_assert_num_queries(0):
        for model in looked_up:
            assert model_spec_for(model=model).draft is not None
