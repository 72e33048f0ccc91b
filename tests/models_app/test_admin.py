"""The Django admin: registering models and aliases through services, and API keys shown exactly once."""

from __future__ import annotations

import re

import pytest

from models_app.catalogue import folders
from models_app.catalogue.live_status import live_fields
from models_app.console import live_state
from models_app.models import ApiKey, Model, ModelAlias, StoredResponse
from tests.support import register_alias

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

MODEL_FORM = {
    "name": "tiny-admin",
    "description": "",
    "source_kind": "local",
    "local_path": "tiny-llama",
    "hf_repo": "",
    "hf_revision": "",
    "concurrency": "1",
    "queue_depth": "16",
    "queue_timeout_s": "",
    "keep_alive_s": "1800",
    "kv_bits": "",
    "kv_group_size": "64",
    "kv_quantized_start": "0",
    # The model page lists its aliases inline (read-only, none to add).
    "aliases-TOTAL_FORMS": "0",
    "aliases-INITIAL_FORMS": "0",
    "aliases-MIN_NUM_FORMS": "0",
    "aliases-MAX_NUM_FORMS": "0",
}
ALIAS_FORM = {
    "name": "tiny-chat",
    "description": "",
    "enabled": "on",
    "temperature": "0.7",
    "top_p": "1.0",
    "top_k": "0",
    "min_p": "0.0",
    "repetition_penalty": "",
    "max_tokens": "256",
    "max_output_tokens": "1024",
    "max_input_tokens": "",
    "speculation": "on",
    "speculation_max_k": "8",
}
MODELS_URL = "/admin/models_app/model/"


def test_admin_registers_a_model_and_an_alias_of_it(admin_client, tiny_model_dir):
    """REG-1: models and aliases are rows edited in the admin; saving a model registers its weights'
    instance, and an alias served from it shares that instance."""
    response = admin_client.post(f"{MODELS_URL}add/", MODEL_FORM)
    assert response.status_code == 302, response.content.decode()[:2000]
    model = Model.objects.get(name="tiny-admin")
    assert model.instance is not None
    response = admin_client.post("/admin/models_app/modelalias/add/", {**ALIAS_FORM, "model": model.pk})
    assert response.status_code == 302, response.content.decode()[:2000]
    alias = ModelAlias.objects.get(name="tiny-chat")
    assert alias.instance == model.instance
    assert alias.max_output_tokens == 1024
    page = admin_client.get(f"{MODELS_URL}{model.pk}/change/").content.decode()
    assert "tiny-chat" in page  # the model page lists the aliases it serves
    add_url = f"/admin/models_app/modelalias/add/?model={model.pk}"
    assert add_url in page  # and offers another alias of it, the model chosen already
    form = admin_client.get(add_url).content.decode()
    assert f'<option value="{model.pk}" selected>' in form


def test_the_alias_form_has_no_lane_or_weights_fields(admin_client, tiny_alias):
    """Issue 11: lane, memory and weights live on the model; the alias page links there instead."""
    page = admin_client.get(f"/admin/models_app/modelalias/{tiny_alias.pk}/change/").content.decode()
    for field in ("concurrency", "queue_depth", "keep_alive_s", "local_path", "pinned"):
        assert f'name="{field}"' not in page, field
    assert f"{MODELS_URL}{tiny_alias.model_id}/change/" in page
    assert "/action/load/" not in page


def test_alias_columns_are_called_as_the_alias_form_calls_them(admin_client, tiny_alias):
    """One place names an alias field (`ALIAS_LABELS`): the model page's inline columns and the
    alias list say what the alias form says, never the model field's own name."""
    pages = [
        admin_client.get(f"/admin/models_app/model/{tiny_alias.model_id}/change/").content.decode(),
        admin_client.get("/admin/models_app/modelalias/").content.decode(),
    ]
    for html in pages:
        headers = " ".join(re.findall(r"<th[^>]*>(.*?)</th>", html, re.DOTALL))
        assert "Default output tokens" in headers
        assert "max tokens" not in headers.lower()
    assert "Output token clamp" in pages[0]
    assert "max output tokens" not in pages[0].lower()


def test_admin_refuses_a_folder_outside_models_root(admin_client, tiny_model_dir):
    response = admin_client.post(f"{MODELS_URL}add/", {**MODEL_FORM, "local_path": "../etc"})
    assert response.status_code == 200
    assert "MODELS_ROOT" in response.content.decode()
    assert not Model.objects.filter(name="tiny-admin").exists()


def test_admin_shows_a_new_api_key_once(admin_client, admin_user):
    response = admin_client.post(
        "/admin/models_app/apikey/add/", {"owner": admin_user.pk, "name": "laptop"}, follow=True
    )
    page = response.content.decode()
    [raw] = set(re.findall(r"mlxh_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}", page))  # the key and its snippets
    key = ApiKey.objects.get(name="laptop")
    assert raw.startswith(key.prefix)
    assert key.secret_hash != raw
    detail = admin_client.get(f"/admin/models_app/apikey/{key.pk}/change/").content.decode()
    assert raw not in detail
    assert key.prefix in detail


def test_admin_lists_tombstones_read_only(admin_client):
    """REG-7: breaker tombstones are visible in the admin and cannot be added or edited there."""
    from models_app.catalogue import services

    tombstone = services.tombstone_record(
        instance_id=3, weights_key=("tiny-llama", "", "f" * 64), public_id="resp_x"
    )
    page = admin_client.get("/admin/models_app/instancetombstone/")
    assert page.status_code == 200 and "resp_x" in page.content.decode()
    assert admin_client.get("/admin/models_app/instancetombstone/add/").status_code == 403
    detail = admin_client.get(f"/admin/models_app/instancetombstone/{tombstone.pk}/change/")
    assert detail.status_code == 200 and 'name="response_public_id"' not in detail.content.decode()


# ADM-1 / OPS-4: live state, actions, model folders, keys and chains ---------------------------------

ALIASES_URL = "/admin/models_app/modelalias/"


@pytest.fixture
def sent(monkeypatch):
    """Control messages that reached the channel layer (sent on commit)."""
    from models_app.catalogue import control

    messages: list[dict] = []
    monkeypatch.setattr(control, "_send", messages.append)
    return messages


def _view(instance_id, **fields):
    view = {
        "instance_id": instance_id,
        "aliases": ["tiny"],
        "state": "ready",
        "status": "ok",
        "error": "",
        "active": 0,
        "queued": 0,
        "capacity": 1,
        "draining": False,
        "warm_sessions": 0,
        "load_progress": {"done": 0, "total": 0},
    }
    view = {**view, **fields}
    # The label comes with the view, named by the engine's status publisher (issue 11, item 6).
    return {**view, **live_fields(state=view["state"], status=view["status"], draining=view["draining"])}


def _publish(*views, actions=None):
    from models_app.catalogue import control

    control.status_publish(
        {"boot_id": "boot-a", "started_at": 1.0, "instances": list(views), "actions": actions or {}}
    )


def _stored(owner, public_id, previous="", text_in="", text_out="", **fields):
    from datetime import timedelta

    from django.utils import timezone

    from models_app.models import StoredResponse

    return StoredResponse.objects.create(
        public_id=public_id,
        owner=owner,
        alias_name="tiny",
        instance_id=1,
        weights_fingerprint="f" * 64,
        boot_id="boot-a",
        previous_response_id=previous,
        request={"input": [{"role": "user", "content": text_in}]},
        output_text=text_out,
        status="completed",
        expires_at=timezone.now() + timedelta(days=1),
        **fields,
    )


def test_every_admin_page_renders(admin_client, tiny_alias, user):
    """ADM-1: changelist, add and change pages of every model render for staff (read-only ones refuse add)."""
    from models_app.catalogue import services
    from models_app.models import InstanceTombstone, StoredResponse

    key, _ = services.apikey_create(owner=user, name="k")
    row = _stored(user, "resp_page", text_in="hi", text_out="hello")
    tomb = services.tombstone_record(
        instance_id=9, weights_key=("tiny-llama", "", "f" * 64), public_id="resp_t"
    )
    pages = {
        "model": (tiny_alias.model_id, 200),
        "modelalias": (tiny_alias.pk, 200),
        "modelinstance": (tiny_alias.instance_id, 403),
        "apikey": (key.pk, 200),
        "storedresponse": (row.pk, 403),
        "instancetombstone": (tomb.pk, 403),
    }
    for model, (pk, add_status) in pages.items():
        base = f"/admin/models_app/{model}/"
        assert admin_client.get(base).status_code == 200, model
        assert admin_client.get(f"{base}add/").status_code == add_status, model
        assert admin_client.get(f"{base}{pk}/change/").status_code == 200, model
    assert admin_client.get(f"/admin/models_app/storedresponse/{row.pk}/chain/").status_code == 200
    assert StoredResponse.objects.count() == 1 and InstanceTombstone.objects.count() == 1


@pytest.mark.parametrize("action", ["load", "unload", "reload"])
def test_bulk_actions_send_the_control_message(
    admin_client, tiny_alias, sent, action, django_capture_on_commit_callbacks
):
    """ADM-1: the changelist's bulk actions ask every engine, on commit, to run the action (LANE-4 there)."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(
            MODELS_URL, {"action": action, "_selected_action": [tiny_alias.model_id]}, follow=True
        )
    assert {"type": "models.action", "model": "tiny", "action": action, "by": "admin"} in sent
    assert f"{action.capitalize()} requested for tiny; progress shows here" in response.content.decode()


@pytest.mark.parametrize("action", ["load", "unload", "reload"])
def test_change_page_buttons_post_the_action(
    admin_client, tiny_alias, sent, action, django_capture_on_commit_callbacks
):
    """ADM-1, ADM-7: the change page has a CSRF-protected POST button per action (an unload's asks
    first, on the confirmation page); the action URL sends the message."""
    url = f"{MODELS_URL}{tiny_alias.model_id}/action/{action}/"
    page = admin_client.get(f"{MODELS_URL}{tiny_alias.model_id}/change/").content.decode()
    if action == "unload":
        assert f'action="/dashboard/models/{tiny_alias.model_id}/unload/"' in page
    else:
        assert f'action="{url}"' in page and "csrfmiddlewaretoken" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(url)
    assert response.status_code == 302 and response["Location"].endswith(f"/{tiny_alias.model_id}/change/")
    assert sent == [{"type": "models.action", "model": "tiny", "action": action, "by": "admin"}]
    shown = admin_client.get(response["Location"]).content.decode()
    assert f"{action.capitalize()} requested for tiny; progress shows here and on the dashboard." in shown


def test_action_url_needs_csrf(client, admin_user, tiny_alias, sent, django_capture_on_commit_callbacks):
    """ADM-1: an action is a state change, so a POST without the CSRF token is refused."""
    from django.test import Client

    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(admin_user)
    with django_capture_on_commit_callbacks(execute=True):
        response = csrf_client.post(f"{MODELS_URL}{tiny_alias.model_id}/action/load/")
    assert response.status_code == 403 and sent == []


def test_get_on_an_action_url_does_nothing(
    admin_client, tiny_alias, sent, django_capture_on_commit_callbacks
):
    """ADM-1: following a link (GET) never loads or unloads a model."""
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = admin_client.get(f"{MODELS_URL}{tiny_alias.model_id}/action/unload/")
    assert response.status_code == 405
    assert sent == [] and callbacks == []


def test_actions_need_staff_with_change_permission(
    client, user, tiny_alias, sent, django_capture_on_commit_callbacks
):
    """ADM-1: a staff member who may only view models cannot request actions."""
    from django.contrib.auth.models import Permission

    user.is_staff = True
    user.save()
    user.user_permissions.add(Permission.objects.get(codename="view_model"))
    client.force_login(user)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"{MODELS_URL}{tiny_alias.model_id}/action/load/")
    assert response.status_code == 403 and sent == []
    page = client.get(f"{MODELS_URL}{tiny_alias.model_id}/change/").content.decode()
    assert "/action/load/" not in page


def test_two_aliases_of_one_model_act_on_it_once(
    admin_client, tiny_alias, sent, django_capture_on_commit_callbacks
):
    """ADM-1: actions belong to the model; a second alias of it adds no second action or lane."""
    from models_app.catalogue import services

    services.alias_register(name="tiny-2", model_name="ignored", source_kind="local", local_path="tiny-llama")
    assert Model.objects.count() == 1
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"{MODELS_URL}{tiny_alias.model_id}/action/load/")
    assert sent == [{"type": "models.action", "model": "tiny", "action": "load", "by": "admin"}]


def test_an_unknown_action_is_refused(admin_client, tiny_alias, sent, django_capture_on_commit_callbacks):
    """ADM-1: only load, unload and reload exist."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(f"{MODELS_URL}{tiny_alias.model_id}/action/explode/", follow=True)
    assert "Unknown action" in response.content.decode() and sent == []


def test_deleting_aliases_notifies_the_engines(
    admin_client, tiny_model_dir, sent, django_capture_on_commit_callbacks
):
    """ADM-1 / ADM-3: single and bulk deletes go through the service, which tells the engines."""

    one = register_alias(name="one", folder="tiny-llama")
    two = register_alias(name="two", folder="tiny-llama")
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"{ALIASES_URL}{one.pk}/delete/", {"post": "yes"})
    assert not ModelAlias.objects.filter(pk=one.pk).exists()
    assert sent == [{"type": "models.changed"}]
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(
            ALIASES_URL, {"action": "delete_selected", "_selected_action": [two.pk], "post": "yes"}
        )
    assert not ModelAlias.objects.filter(pk=two.pk).exists()
    assert sent == [{"type": "models.changed"}] * 2


def test_the_add_form_offers_model_folders(admin_client, tiny_model_dir):
    """ADM-1: registering a model suggests the folders under MODELS_ROOT that look like mlx-lm models."""
    page = admin_client.get(f"{MODELS_URL}add/").content.decode()
    assert 'list="id_local_path_choices"' in page
    assert '<datalist id="id_local_path_choices">' in page
    assert '<option value="tiny-llama"></option>' in page


def test_model_folders_are_listed_two_levels_down(tmp_path):
    """ADM-1: config.json + *.safetensors marks a model folder; deeper and incomplete folders are skipped."""

    def model(folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")

    model(tmp_path / "plain")
    model(tmp_path / "org" / "nested")
    model(tmp_path / "a" / "b" / "too-deep")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    model(tmp_path / ".hidden")
    assert folders.model_folders_available(root=tmp_path) == ["org/nested", "plain"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(
            lambda d: (d / "modeling_evil.py").write_text("import os"), "ships Python code", id="py-file"
        ),
        pytest.param(
            lambda d: _edit_json(d / "config.json", auto_map={"AutoModel": "m.M"}),
            "remote code",
            id="auto-map",
        ),
        pytest.param(
            lambda d: _edit_json(d / "tokenizer_config.json", auto_map={"AutoTokenizer": ["t.T", None]}),
            "auto_map in tokenizer_config.json",
            id="tokenizer-auto-map",
        ),
    ],
)
def test_a_folder_with_remote_code_is_refused(admin_client, tiny_model_dir, mutate, message):
    """ADM-1: the add form refuses remote code with a clear message on the folder field."""
    import shutil

    bad = tiny_model_dir.parent / "tiny-remote"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(tiny_model_dir, bad)
    try:
        mutate(bad)
        response = admin_client.post(f"{MODELS_URL}add/", {**MODEL_FORM, "local_path": "tiny-remote"})
        assert response.status_code == 200
        errors = response.context["adminform"].form.errors
        assert list(errors) == ["local_path"]
        assert message in errors["local_path"][0] and "refused" in errors["local_path"][0]
        assert not Model.objects.filter(name="tiny-admin").exists()
    finally:
        shutil.rmtree(bad)


def _edit_json(path, **fields):
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_hub_model_needs_a_repo_and_pins_its_revision(admin_client, fake_hub):
    """ADM-1 / REG-1 / issue 28: a Hugging Face source takes a repo id and a revision (empty:
    main), errors on the right field, and is saved pinned to the commit the revision names."""
    sha = fake_hub.commit("mlx-community/tiny", {"config.json": b"{}"})
    fake_hub.repos["mlx-community/tiny"].branches["abc123"] = sha
    hub = {**MODEL_FORM, "source_kind": "hub", "local_path": "", "hf_repo": "mlx-community/tiny"}
    response = admin_client.post(f"{MODELS_URL}add/", {**hub, "hf_repo": "not-a-repo", "hf_revision": "abc"})
    assert list(response.context["adminform"].form.errors) == ["hf_repo"]
    response = admin_client.post(f"{MODELS_URL}add/", {**hub, "hf_revision": "nope"})
    assert list(response.context["adminform"].form.errors) == ["hf_revision"]
    response = admin_client.post(f"{MODELS_URL}add/", {**hub, "hf_revision": "abc123"})
    assert response.status_code == 302
    model = Model.objects.get(name="tiny-admin")
    assert (model.hf_revision, model.hf_sha) == ("abc123", sha)
    assert model.source_label == f"mlx-community/tiny@abc123 ({sha[:12]})"


def test_a_new_api_key_is_shown_once_then_only_its_prefix(admin_client, admin_user):
    """ADM-1 / API-5 / KEY-1: the full key appears on the page after creation, never again; the hash never."""
    response = admin_client.post(
        "/admin/models_app/apikey/add/", {"owner": admin_user.pk, "name": "ci"}, follow=True
    )
    [raw] = set(re.findall(r"mlxh_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}", response.content.decode()))
    key = ApiKey.objects.get(name="ci")
    for url in (
        "/admin/models_app/apikey/",
        f"/admin/models_app/apikey/{key.pk}/change/",
        "/admin/models_app/apikey/?q=ci",
    ):
        page = admin_client.get(url).content.decode()
        assert raw not in page and key.secret_hash not in page, url
        assert key.prefix in page, url
    assert 'name="secret_hash"' not in admin_client.get("/admin/models_app/apikey/add/").content.decode()


def test_stored_responses_are_read_only_and_searchable(admin_client, user, django_user_model):
    """ADM-1: stored responses cannot be added or edited in the admin, and are found by owner or text."""
    row = _stored(user, "resp_search", text_in="q", text_out="the purple answer")
    bob = django_user_model.objects.create_user(username="bob", password="pw-bob-123")
    _stored(bob, "resp_other", text_out="nothing")
    for query in ("purple", "alice", "resp_search"):
        page = admin_client.get("/admin/models_app/storedresponse/", {"q": query}).content.decode()
        assert "resp_search" in page and "resp_other" not in page, query
    detail = admin_client.get(f"/admin/models_app/storedresponse/{row.pk}/change/").content.decode()
    assert 'name="output_text"' not in detail and "Conversation chain" in detail
    response = admin_client.post(f"/admin/models_app/storedresponse/{row.pk}/change/", {"output_text": "x"})
    assert response.status_code == 403


def test_the_chain_view_lists_a_three_turn_chain_in_order(admin_client, user, django_user_model):
    """ADM-1 / PER-6: the chain view follows previous_response_id to the root, oldest first, one owner only."""
    from models_app.catalogue import selectors

    mallory = django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")
    _stored(mallory, "resp_foreign", text_in="foreign-question", text_out="foreign-answer")
    _stored(user, "resp_1", text_in="first-question", text_out="first-answer")
    _stored(user, "resp_2", previous="resp_1", text_in="second-question", text_out="second-answer")
    third = _stored(user, "resp_3", previous="resp_2", text_in="third-question", text_out="third-answer")
    page = admin_client.get(f"/admin/models_app/storedresponse/{third.pk}/chain/").content.decode()
    order = [
        page.index(text) for text in ("first-question", "first-answer", "second-question", "third-answer")
    ]
    assert order == sorted(order)
    assert "3 turns" in page and "foreign" not in page
    # A row whose parent belongs to someone else: the walk stops there, as if the parent were missing.
    stray = _stored(user, "resp_stray", previous="resp_foreign", text_in="stray-question")
    chain = selectors.response_chain(response=stray)
    assert [row.public_id for row in chain.turns] == ["resp_stray"] and chain.missing_id == "resp_foreign"
    page = admin_client.get(f"/admin/models_app/storedresponse/{stray.pk}/chain/").content.decode()
    assert "foreign-answer" not in page and "is not stored" in page


def test_the_chain_walk_is_bounded(user):
    """ADM-1: the chain selector reads at most max_depth rows, however long the chain."""
    from models_app.catalogue import selectors

    previous = ""
    for n in range(6):
        row = _stored(user, f"resp_{n}", previous=previous)
        previous = row.public_id
    chain = selectors.response_chain(response=row, max_depth=4)
    assert [r.public_id for r in chain.turns] == ["resp_2", "resp_3", "resp_4", "resp_5"]
    assert chain.truncated


LIVE_CASES = [
    pytest.param(None, None, "no engine process reporting", id="no-engine"),
    pytest.param([], None, "not loaded", id="unloaded"),
    pytest.param(
        [_view(0, state="loading", load_progress={"done": 30, "total": 120})],
        None,
        'value="25" max="100"',
        id="loading-progress",
    ),
    pytest.param(
        [_view(0, state="loading", load_progress={"done": 30, "total": 120, "phase": "read"})],
        None,
        "reading the weights: 25%",
        id="loading-read-phase",
    ),
    pytest.param(
        [_view(0, state="loading", load_progress={"done": 120, "total": 120, "phase": "build"})],
        None,
        '<progress class="mlxhost-progress"></progress> building the model in memory',
        id="loading-build-phase",
    ),
    pytest.param(
        [_view(0, active=2, queued=3, capacity=4, warm_sessions=5)],
        None,
        ("2 / 3 / 4", "2 active / 3 queued (capacity 4)"),
        id="resident",
    ),
    pytest.param(
        [_view(0, active=1, queued=2, capacity=1, can_batch=False, configured_capacity=4)],
        None,
        ("1 / 2 / 1 (cannot batch)", "it serves one request at a time whatever its concurrency says"),
        id="cannot-batch",  # LANE-1, issue 25: the clamp is said on every model and alias page
    ),
    pytest.param([_view(0, draining=True, active=1)], None, "draining", id="draining"),
    pytest.param(
        [_view(0, state="error", status="error", error="weights are corrupt")],
        None,
        "weights are corrupt",
        id="error",
    ),
    pytest.param(
        [_view(0)],
        {"tiny": {"action": "reload", "state": "failed", "error": "no space left", "at": 2.0}},
        "reload failed: no space left",
        id="reload-failed",
    ),
]


@pytest.mark.parametrize(("views", "actions", "shown"), LIVE_CASES)
def test_model_and_alias_pages_show_the_live_state(admin_client, tiny_alias, views, actions, shown):
    """ADM-1 / OPS-4: the model and alias changelists and change pages show each live state the
    engines publish (the last action only on the model's pages, where the actions are)."""
    if views is not None:
        _publish(
            *[{**view, "instance_id": view["instance_id"] or tiny_alias.instance_id} for view in views],
            actions=actions,
        )
    list_text, change_text = shown if isinstance(shown, tuple) else (shown, shown)
    pages = [(MODELS_URL, list_text), (f"{MODELS_URL}{tiny_alias.model_id}/change/", change_text)]
    if actions is None:
        pages += [(ALIASES_URL, list_text), (f"{ALIASES_URL}{tiny_alias.pk}/change/", change_text)]
    for url, text in pages:
        page = admin_client.get(url).content.decode()
        assert text in page, url


def test_model_and_alias_pages_show_the_prefix_cache(admin_client, tiny_alias):
    """Issue 12: the model list, the model page and the alias page show the prefix cache's
    entries, bytes, hit rate and tokens saved."""
    view = _view(
        tiny_alias.instance_id,
        warm_sessions=5,
        warm_bytes=4096,
        cache_hit_rate=0.5,
        cache_tokens_saved=900,
        disk_entries=2,
        disk_bytes=2048,
        disk_hit_rate=0.25,
    )
    _publish(view)
    detail = "5 entries, 4.0\xa0KB; 50% of requests hit, 900 prompt tokens saved"
    disk = "2 saved responses, 2.0\xa0KB; 25% of continuations it was asked for loaded from it"
    pages = [
        (MODELS_URL, ("5 · 50% hits",)),
        (f"{MODELS_URL}{tiny_alias.model_id}/change/", (detail, disk)),
        (f"{ALIASES_URL}{tiny_alias.pk}/change/", (detail, disk)),
    ]
    for url, texts in pages:
        page = admin_client.get(url).content.decode()
        for text in texts:
            assert text in page, url
    _publish(_view(tiny_alias.instance_id))  # an engine without a disk tier
    assert (
        '<th scope="row">Disk tier</th><td>off</td>'
        in admin_client.get(f"{MODELS_URL}{tiny_alias.model_id}/change/").content.decode()
    )


def test_live_state_selector_maps_each_engine_state(tiny_alias):
    """OPS-4: the selector turns an engine's instance view into the state the admin shows."""

    def state(views, actions=None):
        return live_state.alias_live_state(alias=tiny_alias, views=views, actions=actions or {})

    iid = tiny_alias.instance_id
    assert state(None).state == "unreported"
    assert state({}).state == "unloaded"
    loading = state({iid: _view(iid, state="loading", load_progress={"done": 1, "total": 4})})
    assert (loading.state, loading.progress_percent) == ("loading", 25)
    assert state({iid: _view(iid, state="loading")}).progress_percent is None
    assert state({iid: _view(iid)}).state == "resident"
    assert state({iid: _view(iid, status="degraded")}).label == "resident (degraded)"
    assert state({iid: _view(iid, draining=True)}).state == "draining"
    failed = state({iid: _view(iid, state="error", error="boom")})
    assert (failed.state, failed.error) == ("error", "boom")
    # Another alias of the same weights loaded the instance: this one shows it resident too (REG-2).
    assert state({iid: _view(iid, aliases=["other"])}).state == "resident"
    # Mid hot swap the engine already serves the name from a newer instance: that one is shown.
    swapped = state({iid: _view(iid, aliases=[]), iid + 1: _view(iid + 1, state="loading")})
    assert swapped.instance_id == iid + 1 and swapped.state == "loading"
    # A disabled alias is not served, even while its weights are resident for another alias.
    tiny_alias.enabled = False
    assert state({iid: _view(iid, aliases=["other"])}).state == "disabled"
    assert state({iid: _view(iid, aliases=["tiny"], draining=True)}).state == "draining"  # not yet unbound
    tiny_alias.enabled = True
    running = state({}, {"tiny": {"action": "load", "state": "running", "error": "", "at": 1}})
    assert (running.last_action, running.last_action_state) == ("load running", "running")


def test_the_status_line_shows_the_latest_event_not_a_stale_action(tiny_alias):
    """Issue 25 §7: after "unload done" a request loaded the model on demand: the line says so,
    not "unload done" beside a resident badge; a load that the model has since left memory after
    says that too. An action that is still the latest event reads as before."""
    iid = tiny_alias.instance_id

    def line(views, action):
        actions = {"tiny": {"action": action, "state": "done", "error": "", "at": 1}}
        return live_state.alias_live_state(alias=tiny_alias, views=views, actions=actions).last_action

    assert line({iid: _view(iid)}, "unload") == "loaded on demand since the unload"
    assert line({iid: _view(iid, state="loading")}, "unload") == "loaded on demand since the unload"
    assert line({}, "unload") == "unload done"
    assert line({}, "load") == "unloaded since the load"
    assert line({iid: _view(iid)}, "reload") == "reload done"


def test_the_stored_responses_list_previews_each_turn_and_links_the_chat(admin_client, admin_user, user):
    """ADM-5: the list shows each turn's prompt and answer (the answer marked for the Markdown
    renderer, every value escaped), and links the viewer's own turns to the chat page."""
    _stored(
        admin_user, "resp_mine", text_in="What is **2+2**?", text_out="It is **4**.\n\n<script>x()</script>"
    )
    _stored(user, "resp_theirs", text_in="theirs-question", text_out="theirs-answer " * 40)
    page = admin_client.get("/admin/models_app/storedresponse/").content.decode()
    assert '<p class="mlxhost-preview-prompt">What is **2+2**?</p>' in page
    assert "It is **4**.\n\n&lt;script&gt;x()&lt;/script&gt;</div>" in page and "<script>x()" not in page
    assert 'class="mlxhost-preview-answer chat-md" data-markdown' in page
    assert "theirs-answer theirs-answer" in page and "\u2026</div>" in page  # long answers are cut
    assert page.count('class="mlxhost-continue"') == 1
    assert '<a href="/dashboard/chat/?response=resp_mine" class="mlxhost-continue">in chat</a>' in page
    assert "another user&#x27;s" in page
    assert "mlxhost/markdown.js" in page and "mlxhost/stored_responses.js" in page
    mine = StoredResponse.objects.get(public_id="resp_mine")
    detail = admin_client.get(f"/admin/models_app/storedresponse/{mine.pk}/change/").content.decode()
    assert 'href="/dashboard/chat/?response=resp_mine" id="mlxhost-continue"' in detail
    assert 'chat-md" data-markdown>It is **4**.' in detail


def test_the_stored_responses_list_says_what_the_chain_link_opens(admin_client, user):
    """A new user's walk: the chain column read "follow back" / "root"; it now names what the link shows."""
    _stored(user, "resp_first", text_in="q1", text_out="a1")
    _stored(user, "resp_next", previous="resp_first", text_in="q2", text_out="a2")
    page = admin_client.get("/admin/models_app/storedresponse/").content.decode()
    assert "follow back" not in page
    assert ">first turn</a>" in page and ">earlier turns</a>" in page


def test_the_admin_header_has_no_view_site_link_back_to_itself(admin_client):
    """A new user's walk: "View site" went to "/", which redirects to this admin; the header's own
    links (dashboard, models, chat) are the site."""
    page = admin_client.get("/admin/").content.decode()
    assert "View site" not in page
    assert 'href="/dashboard/chat/"' in page
