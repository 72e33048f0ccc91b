"""The live Models page, its actions and the unload confirmation, the admin index's summary (ADM-7,
ADM-1, OPS-4, API-5), and the model and alias forms' labels, help and errors (ADM-8)."""

from __future__ import annotations

import json
import re
import time

import pytest
from django.contrib.auth.models import Permission

from models_app.catalogue import control
from models_app.catalogue.live_status import idle_unload_fields, live_fields
from models_app.console.forms import ALIAS_FORM_FIELDS, MODEL_FORM_FIELDS, ModelAliasForm, ModelForm
from models_app.models import ModelAlias
from tests.support import register_alias

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

URL = "/dashboard/models/"
BUTTON = re.compile(r'<button type="submit" class="button action-(\w+)"[^>]*?( disabled)?>')


@pytest.fixture
def sent(monkeypatch):
    """Control messages that reached the channel layer (sent on commit)."""
    messages: list[dict] = []
    monkeypatch.setattr(control, "_send", messages.append)
    return messages


@pytest.fixture
def shared(tiny_model_dir):
    """One model served by two aliases, `tiny` and `tiny-chat`."""
    alias = register_alias(name="tiny", folder="tiny-llama")
    register_alias(name="tiny-chat", folder="tiny-llama")  # the same weights: the same model
    assert ModelAlias.objects.get(name="tiny-chat").model_id == alias.model_id
    return alias.model


def view(instance_id: int, *, state: str = "ready", status: str = "ok", **fields) -> dict:
    """One instance as the status publisher reports it."""
    live = live_fields(state=state, status=status, draining=False)
    return {
        "instance_id": instance_id,
        "aliases": ["tiny", "tiny-chat"],
        "state": state,
        "status": status,
        **live,
        **idle_unload_fields(
            live_state=live["live_state"], pinned=False, keep_alive_s=1800, idle_s=600, busy=False
        ),
        "error": "",
        "active": 1,
        "queued": 2,
        "capacity": 4,
        "draining": False,
        "tokens_per_s": 42.5,
        "ttft_ms": 12.0,
        "queue_ms": 2.0,
        "warm_sessions": 3,
        "warm_bytes": 2048,
        "cache_hit_rate": 0.625,
        "memory_bytes": 5 * 1024 * 1024,
        "load_progress": {"done": 0, "total": 0, "unit": "bytes"},
        **fields,
    }


def publish(*views: dict, actions: dict | None = None) -> None:
    control.status_publish(
        {
            "boot_id": "boot-m",
            "host": "box",
            "pid": 1,
            "started_at": 1.0,
            "at": time.time(),
            "instances": list(views),
            "actions": actions or {},
        }
    )


def buttons(page: str, model: str) -> dict[str, bool]:
    """The action buttons of `model`'s row: name -> enabled."""
    row = re.search(rf'<tr data-model-id="\d+" data-model="{model}".*?</tr>', page, flags=re.S)
    assert row, f"no row for {model}"
    return {name: not disabled for name, disabled in BUTTON.findall(row.group(0))}


# Who may see it and act -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", [URL, "/dashboard/models/1/unload/"])
def test_anonymous_visitors_are_sent_to_the_login(client, url):
    """API-5: staff pages need a session."""
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


def test_a_page_script_left_open_after_logout_is_told_the_session_ended(client, shared, sent):
    """API-5: a script's action without a session gets 401 JSON saying so, never the login page's
    HTML (which read as a success with no message); nothing is sent to the engines."""
    response = client.post(
        f"/dashboard/models/{shared.pk}/load/", {"next": URL}, headers={"Accept": "application/json"}
    )
    assert response.status_code == 401
    assert response.json() == {
        "message": "Your session has ended: log in again to act.",
        "code": "session_ended",
    }
    assert sent == []


def test_non_staff_users_are_refused(client, user, shared):
    """ADM-7: the Models page is for staff."""
    client.force_login(user)
    assert client.get(URL).status_code == 403


def test_view_only_staff_see_the_page_without_buttons_and_cannot_act(client, user, shared, sent):
    """ADM-7: acting needs the change permission on models; viewing does not."""
    user.is_staff = True
    user.save()
    user.user_permissions.add(Permission.objects.get(codename="view_model"))
    client.force_login(user)
    page = client.get(URL).content.decode()
    assert 'data-model="tiny"' in page and buttons(page, "tiny") == {}
    assert "view only" in page
    response = client.post(f"/dashboard/models/{shared.pk}/load/")
    assert response.status_code == 403 and sent == []


# What it shows -------------------------------------------------------------------------------------------


def test_every_model_is_listed_with_its_aliases_and_live_figures(admin_client, shared, tiny_model_b_dir):
    """ADM-7: each model, its aliases, state, memory, idle unload, lane, tokens/s and hit rate."""
    register_alias(name="other", folder="tiny-llama-b", enabled=False)
    publish(view(shared.instance_id))
    page = admin_client.get(URL).content.decode()
    row = re.search(r'data-model="tiny".*?</tr>', page, flags=re.S).group(0)
    assert "tiny-chat" in row and "badge-resident" in row
    assert "5.0\xa0MB" in row  # memory
    assert "in 20 min" in row  # 1800 s keep-alive, idle for 600
    assert "1 / 2 / 4" in row and "42.5" in row and "62%" in row
    other = re.search(r'data-model="other".*?</tr>', page, flags=re.S).group(0)
    assert "(disabled)" in other and "not loaded" in other
    data = json.loads(re.search(r'id="models-data" type="application/json">(.*?)</script>', page).group(1))
    assert {
        "name": "tiny",
        "aliases": ["tiny", "tiny-chat"],
        "serving": ["tiny", "tiny-chat"],
    }.items() <= next(model for model in data if model["name"] == "tiny").items()


def test_a_loading_model_shows_a_progress_bar(admin_client, shared):
    """OPS-4: loading shows its progress."""
    publish(
        view(shared.instance_id, state="loading", status="loading", load_progress={"done": 1, "total": 4})
    )
    page = admin_client.get(URL).content.decode()
    assert '<progress max="100" value="25"></progress>' in page and "25%" in page


@pytest.mark.parametrize(
    ("instance", "actions", "enabled"),
    [
        pytest.param(None, {}, {"load"}, id="not-loaded"),
        pytest.param({"state": "ready"}, {}, {"unload", "reload"}, id="resident"),
        pytest.param({"state": "ready", "status": "degraded"}, {}, {"unload", "reload"}, id="degraded"),
        pytest.param({"state": "loading", "status": "loading"}, {}, set(), id="loading"),
        pytest.param(
            {"state": "error", "status": "error", "error": "no config"}, {}, {"load", "reload"}, id="error"
        ),
        pytest.param(
            {"state": "ready"},
            {"tiny": {"action": "reload", "state": "running", "error": "", "at": 2.0}},
            set(),
            id="an-action-runs",
        ),
    ],
)
def test_the_buttons_match_the_state(admin_client, shared, instance, actions, enabled):
    """ADM-7: only the actions that fit the state are enabled; the others are disabled."""
    publish(*([view(shared.instance_id, **instance)] if instance else []), actions=actions)
    page = admin_client.get(URL).content.decode()
    shown = buttons(page, "tiny")
    assert set(shown) == {"load", "unload", "reload"}
    assert {name for name, on in shown.items() if on} == enabled
    assert 'id="models-page-data"' in page  # the same table, for the page's script
    table = json.loads(
        re.search(r'id="models-page-data" type="application/json">(.*?)</script>', page).group(1)
    )
    assert table["actions_by_state"]["resident"] == ["unload", "reload"]


def test_no_button_is_enabled_while_no_engine_reports(admin_client, shared):
    """ADM-7: with no engine process reporting, an action would reach no one."""
    page = admin_client.get(URL).content.decode()
    assert not any(buttons(page, "tiny").values())
    assert "no engine process reporting" in page


# Actions and the confirmation --------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["load", "reload"])
def test_load_and_reload_go_through_the_service_and_come_back(
    admin_client, shared, sent, action, django_capture_on_commit_callbacks
):
    """ADM-1, ADM-7: a POST asks every engine on commit, then returns to the page it came from."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(f"/dashboard/models/{shared.pk}/{action}/", {"next": URL})
    assert response.status_code == 302 and response["Location"] == URL
    assert sent == [{"type": "models.action", "model": "tiny", "action": action, "by": "admin"}]
    assert f"{action.capitalize()} requested for tiny." in admin_client.get(URL).content.decode()


def test_the_page_script_gets_json(admin_client, shared, sent, django_capture_on_commit_callbacks):
    """ADM-7: the page sends actions without leaving it: JSON in, 202 and the message out."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(
            f"/dashboard/models/{shared.pk}/unload/",
            {"confirmed": "1"},
            headers={"Accept": "application/json"},
        )
    assert response.status_code == 202
    assert response.json() == {"message": "Unload requested for tiny.", "model": "tiny", "action": "unload"}
    assert sent == [{"type": "models.action", "model": "tiny", "action": "unload", "by": "admin"}]


@pytest.mark.parametrize("method", ["get", "post"])
def test_an_unload_asks_first_naming_every_alias_it_takes_down(
    admin_client, shared, sent, method, django_capture_on_commit_callbacks
):
    """ADM-7: an unconfirmed unload (a link, or a form without `confirmed`) only shows what it
    would take down; confirming it sends the action and returns to `next`."""
    url = f"/dashboard/models/{shared.pk}/unload/"
    back = f"/admin/models_app/model/{shared.pk}/change/"
    with django_capture_on_commit_callbacks(execute=True):
        response = getattr(admin_client, method)(url, {"next": back})
    page = response.content.decode()
    assert response.status_code == 200 and sent == []
    assert "<code>tiny</code>" in page and "<code>tiny-chat</code>" in page
    assert 'name="confirmed" value="1"' in page and f'name="next" value="{back}"' in page
    assert response["Content-Security-Policy"].startswith("default-src 'self'")
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(url, {"confirmed": "1", "next": back})
    assert response.status_code == 302 and response["Location"] == back
    assert sent == [{"type": "models.action", "model": "tiny", "action": "unload", "by": "admin"}]


def test_the_unload_question_says_the_next_request_loads_it_again(admin_client, shared):
    """A new user's walk: both unload questions read "new ones are refused until it loads again (the
    next request for it loads it)", refused and loaded at once; an unloaded model loads on demand."""
    pages = [
        admin_client.get("/dashboard/models/").content.decode(),
        admin_client.get(f"/dashboard/models/{shared.pk}/unload/").content.decode(),
    ]
    for page in pages:
        assert "refused until it loads again" not in page
        assert "refused while it drains" in page and "the next request for it loads it again" in page


def test_an_offsite_next_is_ignored(admin_client, shared, sent, django_capture_on_commit_callbacks):
    """API-5: `next` never sends the browser to another site."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(
            f"/dashboard/models/{shared.pk}/load/", {"next": "https://evil.example/"}
        )
    assert response["Location"] == URL


@pytest.mark.parametrize(
    ("path", "status"),
    [
        pytest.param("/dashboard/models/{pk}/explode/", 404, id="unknown-action"),
        pytest.param("/dashboard/models/999999/load/", 404, id="unknown-model"),
    ],
)
def test_bad_action_urls_are_4xx(
    admin_client, shared, sent, path, status, django_capture_on_commit_callbacks
):
    """API-4: bad input is a 4xx, never a 5xx, and nothing is sent."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(path.format(pk=shared.pk))
    assert response.status_code == status and sent == []


def test_a_link_never_loads_a_model(admin_client, shared, sent, django_capture_on_commit_callbacks):
    """ADM-7: load and reload change state, so GET is refused."""
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.get(f"/dashboard/models/{shared.pk}/load/")
    assert response.status_code == 405 and sent == []


def test_actions_need_the_csrf_token(client, admin_user, shared, sent, django_capture_on_commit_callbacks):
    """API-5: a state change without the CSRF token is refused."""
    from django.test import Client

    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(admin_user)
    with django_capture_on_commit_callbacks(execute=True):
        response = csrf_client.post(f"/dashboard/models/{shared.pk}/load/")
    assert response.status_code == 403 and sent == []


# The admin: the index's summary and the model page's buttons ------------------------------------------


def test_the_admin_index_says_which_models_are_up(admin_client, shared, tiny_model_b_dir):
    """ADM-7: the admin index summarises which models are up and links to the Models page."""
    register_alias(name="other", folder="tiny-llama-b")
    page = admin_client.get("/admin/").content.decode()
    assert 'id="models-up"' in page and "No engine process is reporting" in page
    publish(view(shared.instance_id))
    page = admin_client.get("/admin/").content.decode()
    assert re.search(r"<strong>1 of 2</strong> models resident: tiny\.", page)
    assert f'href="{URL}"' in page


def test_every_admin_page_links_to_the_models_page_and_chat(admin_client):
    """ADM-7: the admin header links to the Models page and to chat."""
    page = admin_client.get("/admin/").content.decode()
    assert f'<a href="{URL}">Models</a>' in page and '<a href="/dashboard/chat/">Chat</a>' in page


@pytest.mark.parametrize(
    ("instance", "enabled"),
    [
        pytest.param(None, {"load"}, id="not-loaded"),
        pytest.param({"state": "ready"}, {"unload", "reload"}, id="resident"),
    ],
)
def test_the_model_admin_page_disables_what_does_not_fit(admin_client, shared, instance, enabled):
    """ADM-7: the model's admin page offers the same actions as the Models page; its unload asks first."""
    publish(*([view(shared.instance_id, **instance)] if instance else []))
    page = admin_client.get(f"/admin/models_app/model/{shared.pk}/change/").content.decode()
    found = dict(re.findall(r'name="action" value="(\w+)" formaction="[^"]*"( disabled)?>', page))
    assert {name for name, disabled in found.items() if not disabled} == enabled
    assert f'formaction="/dashboard/models/{shared.pk}/unload/"' in page


# The forms ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("form", "fields"),
    [
        pytest.param(ModelForm, MODEL_FORM_FIELDS, id="model"),
        pytest.param(ModelAliasForm, ALIAS_FORM_FIELDS, id="alias"),
    ],
)
def test_every_field_has_a_human_label_and_help(form, fields, tiny_model_dir):
    """ADM-8: every setting says what it is, its range and what empty means."""
    bound = form()
    for name in fields:
        field = bound.fields[name]
        assert field.label and field.label[0].isupper() and "_" not in field.label, name
        assert len(field.help_text) > 20, name
    for name in ("keep_alive_s", "queue_timeout_s", "max_input_tokens", "repetition_penalty"):
        if name in fields:
            assert "Empty" in bound.fields[name].help_text, name


def test_the_model_form_shows_every_error_at_once(admin_client, tiny_model_dir):
    """ADM-8: a bad folder and bad lane settings are reported together, each on its field."""
    from tests.models_app.test_admin import MODEL_FORM

    response = admin_client.post(
        "/admin/models_app/model/add/",
        {**MODEL_FORM, "local_path": "../etc", "concurrency": "0", "queue_timeout_s": "0"},
    )
    errors = response.context["adminform"].form.errors
    assert set(errors) == {"local_path", "concurrency", "queue_timeout_s"}


def test_the_alias_form_names_the_field_of_a_default_over_the_clamp(admin_client, shared):
    """ADM-8: a default output length over the clamp is an error on that field, with the others."""
    from tests.models_app.test_admin import ALIAS_FORM

    response = admin_client.post(
        "/admin/models_app/modelalias/add/",
        {
            **ALIAS_FORM,
            "name": "tiny-other",
            "model": shared.pk,
            "max_tokens": "2048",
            "max_output_tokens": "1024",
            "temperature": "9",
        },
    )
    errors = response.context["adminform"].form.errors
    assert set(errors) == {"max_tokens", "temperature"}
    assert "above the clamp (1024)" in errors["max_tokens"][0]


def test_the_folder_suggestions_are_visible(admin_client, tiny_model_dir):
    """ADM-8: the folders found under MODELS_ROOT show on the page, as buttons that fill the field."""
    page = admin_client.get("/admin/models_app/model/add/").content.decode()
    assert re.search(
        r'<button type="button" class="mlxhost-suggestion" data-fill="id_local_path" value="tiny-llama">tiny-llama</button>',
        page,
    )
    assert "mlxhost/model_form.js" in page


# A fleet (issue 15) -------------------------------------------------------------------------------------


def publish_host(host_id: int, *views: dict) -> None:
    control.status_publish(
        {
            "boot_id": f"boot-h{host_id}",
            "host": "box",
            "host_id": host_id,
            "pid": host_id,
            "started_at": float(host_id),
            "at": time.time(),
            "instances": list(views),
            "actions": {},
        }
    )


def test_the_model_page_shows_each_host_and_can_act_on_one(
    admin_client, shared, sent, django_capture_on_commit_callbacks
):
    """Issue 15: with two fleet hosts the model page shows each host's figures beside the totals,
    and its actions can name one host (a reload of every host rolls)."""
    publish_host(1, view(shared.instance_id, active=2, queued=2, capacity=2))
    publish_host(2, view(shared.instance_id, active=0, queued=0, capacity=2))
    page = admin_client.get(f"/admin/models_app/model/{shared.pk}/change/").content.decode()
    assert '<option value="2">h02 only</option>' in page
    assert re.search(r"<th scope=\"row\">h01</th><td>resident</td><td>2 / 2 / 2</td>", page)
    assert re.search(r"<th scope=\"row\">h02</th><td>resident</td><td>0 / 0 / 2</td>", page)
    url = f"/admin/models_app/model/{shared.pk}/action/reload/"
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(url, {"host": "2"})
        admin_client.post(url, {"host": ""})
        admin_client.post(url, {"host": "9"})  # no such host: refused, nothing sent
    assert [(m.get("host"), "rolling" in m) for m in sent] == [(2, False), (None, True)]
    assert sent[1]["rolling"]["order"] == [1, 2]
