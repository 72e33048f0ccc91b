"""The Django admin: registering aliases through services, and API keys shown exactly once."""

from __future__ import annotations

import re

import pytest

from models_app.models import ApiKey, ModelAlias

pytestmark = [pytest.mark.django_db]

ALIAS_FORM = {
    "name": "tiny-admin",
    "description": "",
    "enabled": "on",
    "source_kind": "local",
    "local_path": "tiny-llama",
    "hf_repo": "",
    "hf_revision": "",
    "temperature": "0.7",
    "top_p": "1.0",
    "top_k": "0",
    "min_p": "0.0",
    "repetition_penalty": "",
    "max_tokens": "256",
    "max_output_tokens": "1024",
    "max_input_tokens": "",
    "concurrency": "1",
    "queue_depth": "16",
    "queue_timeout_s": "",
    "keep_alive_s": "1800",
}


def test_admin_registers_an_alias_bound_to_an_instance(admin_client, tiny_model_dir):
    """REG-1: aliases are rows edited in the admin; saving binds the weights' instance."""
    response = admin_client.post("/admin/models_app/modelalias/add/", ALIAS_FORM)
    assert response.status_code == 302, response.content.decode()[:2000]
    alias = ModelAlias.objects.get(name="tiny-admin")
    assert alias.instance is not None
    assert alias.max_output_tokens == 1024


def test_admin_refuses_a_folder_outside_models_root(admin_client, tiny_model_dir):
    response = admin_client.post("/admin/models_app/modelalias/add/", {**ALIAS_FORM, "local_path": "../etc"})
    assert response.status_code == 200
    assert "MODELS_ROOT" in response.content.decode()
    assert not ModelAlias.objects.filter(name="tiny-admin").exists()


def test_admin_shows_a_new_api_key_once(admin_client, admin_user):
    response = admin_client.post(
        "/admin/models_app/apikey/add/", {"owner": admin_user.pk, "name": "laptop"}, follow=True
    )
    page = response.content.decode()
    [raw] = re.findall(r"mlxh_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}", page)
    key = ApiKey.objects.get(name="laptop")
    assert raw.startswith(key.prefix)
    assert key.secret_hash != raw
    detail = admin_client.get(f"/admin/models_app/apikey/{key.pk}/change/").content.decode()
    assert raw not in detail
    assert key.prefix in detail


def test_admin_lists_tombstones_read_only(admin_client):
    """REG-7: breaker tombstones are visible in the admin and cannot be added or edited there."""
    from models_app import services

    tombstone = services.tombstone_record(
        instance_id=3, weights_key=("tiny-llama", "", "f" * 64), public_id="resp_x"
    )
    page = admin_client.get("/admin/models_app/instancetombstone/")
    assert page.status_code == 200 and "resp_x" in page.content.decode()
    assert admin_client.get("/admin/models_app/instancetombstone/add/").status_code == 403
    detail = admin_client.get(f"/admin/models_app/instancetombstone/{tombstone.pk}/change/")
    assert detail.status_code == 200 and 'name="response_public_id"' not in detail.content.decode()
