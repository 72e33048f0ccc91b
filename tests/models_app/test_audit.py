"""The audit trail: loads, unloads, reloads, settings and key changes in each object's admin history."""

from __future__ import annotations

import html
import logging
import re

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.template.defaultfilters import date as date_filter
from django.utils import timezone

from models_app.catalogue import services
from models_app.models import ApiKey

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

MODELS_URL = "/admin/models_app/model/"
ROW = re.compile(r'<th scope="row">(.*?)</th>\s*<td>(.*?)</td>\s*<td>(.*?)</td>', re.S)


@pytest.fixture
def sent(monkeypatch):
    """Control messages that reached the channel layer (none leave the test)."""
    from models_app.catalogue import control

    messages: list[dict] = []
    monkeypatch.setattr(control, "_send", messages.append)
    return messages


def history(client, obj) -> list[tuple[str, str, str]]:
    """The rows (when, who, what) of `obj`'s stock admin history page, oldest first."""
    opts = obj._meta
    page = client.get(f"/admin/{opts.app_label}/{opts.model_name}/{obj.pk}/history/")
    assert page.status_code == 200
    return [tuple(html.unescape(cell.strip()) for cell in row) for row in ROW.findall(page.content.decode())]


def shown_time(entry: LogEntry) -> str:
    """The action time as the history page prints it."""
    return date_filter(timezone.localtime(entry.action_time), "DATETIME_FORMAT")


def entries(obj) -> list[LogEntry]:
    found = LogEntry.objects.filter(object_id=str(obj.pk), content_type__model=obj._meta.model_name)
    return list(found.order_by("action_time", "pk"))


@pytest.mark.parametrize("action", ["load", "unload", "reload"])
@pytest.mark.parametrize("via", ["bulk action", "change page button"])
def test_an_action_shows_in_the_model_history_with_who_and_when(
    admin_client, admin_user, tiny_alias, sent, action, via, django_capture_on_commit_callbacks
):
    """ADM-6: a load, unload or reload asked for in the admin is in the model's history page:
    the staff member, the time and the action."""
    model = tiny_alias.model
    before = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        if via == "bulk action":
            admin_client.post(MODELS_URL, {"action": action, "_selected_action": [model.pk]})
        else:
            admin_client.post(f"{MODELS_URL}{model.pk}/action/{action}/")
    [entry] = entries(model)
    assert (entry.user, entry.action_flag) == (admin_user, CHANGE)
    assert before <= entry.action_time <= timezone.now()
    assert history(admin_client, model) == [(shown_time(entry), "admin", f"Requested {action}.")]
    assert sent[-1]["by"] == "admin"


def test_a_settings_change_through_a_service_names_the_changed_fields(
    admin_client, admin_user, tiny_alias, sent
):
    """ADM-6: an alias or model edit made outside the admin's forms (a service given its actor)
    is in the history with the fields it changed; a save that changes nothing adds nothing."""
    tiny_alias.temperature, tiny_alias.max_output_tokens = 0.3, 512
    services.alias_save(alias=tiny_alias, actor=admin_user)
    services.alias_save(alias=tiny_alias, actor=admin_user)  # nothing changed this time
    model = tiny_alias.model
    model.concurrency = 2
    services.model_save(model=model, actor=admin_user)

    [(when, who, what)] = history(admin_client, tiny_alias)
    assert (when, who) == (shown_time(entries(tiny_alias)[0]), "admin")
    assert what == "Changed Temperature and Max output tokens."
    assert [row[1:] for row in history(admin_client, model)] == [("admin", "Changed Concurrency.")]


def test_an_admin_form_save_is_recorded_once(admin_client, tiny_alias, sent):
    """ADM-6: the change form's own history entry is the only one for its save (the service it
    calls records nothing more)."""
    url = f"/admin/models_app/modelalias/{tiny_alias.pk}/change/"
    form = {
        "name": "tiny",
        "description": "",
        "model": tiny_alias.model_id,
        "enabled": "on",
        "temperature": "0.5",
        "top_p": "1.0",
        "top_k": "0",
        "min_p": "0.0",
        "repetition_penalty": "",
        "max_tokens": "256",
        "max_output_tokens": "1024",
        "max_input_tokens": "",
        "chat_template_kwargs": "{}",
        "speculation": "on",
        "speculation_max_k": "8",
    }
    response = admin_client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    [(_, who, what)] = history(admin_client, tiny_alias)
    assert who == "admin" and what.startswith("Changed") and "Temperature" in what


def test_key_creation_and_revocation_show_in_the_key_history(admin_client, admin_user, user):
    """ADM-6: creating a key (the admin's add form, or a service given its actor) and revoking it
    (the admin's action) are in the key's history with who and when."""
    response = admin_client.post("/admin/models_app/apikey/add/", {"owner": user.pk, "name": "ci"})
    assert response.status_code == 302
    key = ApiKey.objects.get(name="ci")
    admin_client.post(
        "/admin/models_app/apikey/", {"action": "revoke", "_selected_action": [key.pk], "confirmed": "1"}
    )
    added, revoked = entries(key)
    assert (added.action_flag, revoked.action_flag) == (ADDITION, CHANGE)
    assert history(admin_client, key) == [
        (shown_time(added), "admin", "Added."),
        (shown_time(revoked), "admin", "Revoked."),
    ]
    scripted, _ = services.apikey_create(owner=user, name="scripted", actor=admin_user)
    assert history(admin_client, scripted) == [(shown_time(entries(scripted)[0]), "admin", "Added.")]


def test_recent_actions_on_the_admin_index_say_what_was_done(
    admin_client, admin_user, tiny_alias, sent, django_capture_on_commit_callbacks
):
    """ADM-6, issue 25 §7: the index's Recent actions give each entry its verb (the change
    message), not the object's name alone: a requested load, a revoked key, a save's fields."""
    model = tiny_alias.model
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(f"{MODELS_URL}{model.pk}/action/load/")
    key, _ = services.apikey_create(owner=admin_user, name="ci", actor=admin_user)
    services.apikey_revoke(key=key, actor=admin_user)
    page = admin_client.get("/admin/").content.decode()
    module = page[page.index('id="recent-actions-module"') :]
    said = [html.unescape(m) for m in re.findall(r'<span class="mlxhost-log-message">(.*?)</span>', module)]
    assert said[:3] == ["Revoked.", "Added.", "Requested load."], said


def test_a_reload_switch_is_recorded_once_as_the_requesters(admin_client, tiny_alias, admin_user, sent):
    """ADM-6: when a reload's new weights take over, the model's history says so, in the name of
    who asked for the reload, once however many engine processes report it."""
    model = tiny_alias.model
    fresh = services.instance_register(
        source_kind="local", source="tiny-llama", revision="", fingerprint="f" * 64
    )
    services.model_switch_instance(model=model, instance=fresh, requested_by="admin")
    services.model_switch_instance(model=model, instance=fresh, requested_by="admin")  # a second engine
    assert [row[1:] for row in history(admin_client, model)] == [
        ("admin", f"Reloaded: now serving instance #{fresh.pk}.")
    ]


def test_a_change_without_a_signed_in_user_goes_to_the_log(tiny_alias, user, caplog, sent):
    """ADM-6: a script's change (no user to name) has no history entry but a log line, and the
    line carries no key material."""
    with caplog.at_level(logging.INFO, logger="models_app.catalogue.audit"):
        key, raw = services.apikey_create(owner=user, name="script")
        services.apikey_revoke(key=key)
    assert entries(key) == []
    assert "Revoked." in caplog.text and raw not in caplog.text and key.secret_hash not in caplog.text
