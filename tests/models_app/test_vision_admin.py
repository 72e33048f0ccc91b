"""A vision model in the admin (issue 29): its kind detected from the folder, its page saying it
serves one request at a time, and what to install when the vision extra is missing."""

from __future__ import annotations

import pytest

from models_app.catalogue import specs
from models_app.console import admin as console_admin
from models_app.models import Model
from tests.models_app.test_admin import MODELS_URL

pytestmark = pytest.mark.django_db


def test_the_tiny_llava_registers_as_a_vision_model(vision_alias):
    assert vision_alias.model.kind == Model.Kind.VISION
    assert specs.model_spec_for(model=vision_alias.model).kind == "vision"


def test_a_vision_models_page_says_it_runs_alone_and_what_to_install(admin_client, vision_alias, monkeypatch):
    url = f"{MODELS_URL}{vision_alias.model.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert "Vision models run one request at a time" in page
    assert "make install-vision" not in page  # the extra is installed here
    monkeypatch.setattr(console_admin, "vision_extra_installed", lambda: False)
    page = admin_client.get(url).content.decode()
    assert "make install-vision" in page


def test_a_chat_models_page_says_nothing_of_vision(admin_client, tiny_alias):
    page = admin_client.get(f"{MODELS_URL}{tiny_alias.model.pk}/change/").content.decode()
    assert "Vision models" not in page
