"""Migration 0011 (issue 28): a hub model whose revision is already a commit is pinned to it; a
branch or a tag waits for the next save, which resolves it (no network in a migration)."""

from __future__ import annotations

import pytest

from tests.models_app.test_migrations import _migrate, executor_leaf

pytestmark = [pytest.mark.django_db(transaction=True)]

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_a_commit_revision_is_pinned_and_a_tag_is_left_to_the_next_save():
    apps = _migrate([("models_app", "0010_model_draft")])
    try:
        Model = apps.get_model("models_app", "Model")
        Model.objects.create(name="by-sha", source_kind="hub", hf_repo="org/a", hf_revision=SHA)
        Model.objects.create(name="by-tag", source_kind="hub", hf_repo="org/b", hf_revision="v1.0")
        apps = _migrate([("models_app", "0011_model_hub_pin")])
        Model = apps.get_model("models_app", "Model")
        assert dict(Model.objects.values_list("name", "hf_sha")) == {"by-sha": SHA, "by-tag": ""}
    finally:
        _migrate(executor_leaf())
