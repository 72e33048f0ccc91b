"""The staff dashboard page: who may see it, what it renders, and its browser hardening (ADM-2, API-5)."""

from __future__ import annotations

import itertools
import json
import re
import time

import pytest

from models_app.catalogue import control
from models_app.catalogue.live_status import live_fields
from tests.support import register_alias

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

URL = "/dashboard/"


@pytest.fixture
def staff_client(client, django_user_model):
    staff = django_user_model.objects.create_user(username="ops", password="pw-ops-123", is_staff=True)
    client.force_login(staff)
    return client


@pytest.fixture
def tiny_enabled(tiny_model_dir):
    return register_alias(name="tiny-dash", folder="tiny-llama")


def engine_status(**instance) -> dict:
    view = {
        "instance_id": 7,
        "aliases": ["tiny-dash"],
        "state": "ready",
        "status": "ok",
        "error": "",
        "active": 1,
        "queued": 2,
        "capacity": 4,
        "draining": False,
        "tokens_per_s": 42.5,
        "decode_tps": 50.0,
        "ttft_ms": 12.3,
        "batch_size": 1,
        "warm_sessions": 3,
        "warm_bytes": 2048,
        "cache_hit_rate": 0.625,
        "cache_tokens_saved": 1200,
        "disk_entries": 4,
        "disk_bytes": 3 * 1024 * 1024,
        "disk_hit_rate": 1.0,
        "memory_bytes": 5 * 1024 * 1024,
        "load_progress": {"done": 0, "total": 0},
        "requests_finished": 9,
        "stalled_s": 0.0,
        **instance,
    }
    view.update(live_fields(state=view["state"], status=view["status"], draining=view["draining"]))
    return {
        "boot_id": "boot-1",
        "host": "box",
        "pid": 4242,
        "started_at": time.time(),
        "at": time.time(),
        "instances": [view],
        "actions": {},
    }


def test_anonymous_visitors_are_sent_to_the_admin_login(client):
    """API-5: browser pages use Django sessions; no session, no dashboard."""
    response = client.get(URL)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
    assert f"next={URL}" in response["Location"]


def test_signed_in_non_staff_users_are_refused(client, user):
    """ADM-2: the dashboard is for staff only."""
    client.force_login(user)
    response = client.get(URL)
    assert response.status_code == 403
    assert b"instances-table" not in response.content


def test_staff_sees_the_instance_table_skeleton_and_the_enabled_aliases(staff_client, tiny_enabled):
    """ADM-2: the live table's columns and the enabled aliases render on first paint; chat and the
    load buttons have pages of their own, linked from here."""
    register_alias(name="tiny-off", folder="tiny-llama", enabled=False)
    response = staff_client.get(URL)
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="instances-table"' in page
    assert 'id="instances-body"' in page
    for column in (
        "Instance",
        "Aliases",
        "State",
        "Active / queued / capacity",
        "Tokens/s",
        "TTFT (ms, incl. queue)",
    ):
        assert column in page
    assert "Prefix cache" in page and "Cache bytes" in page and "Memory" in page
    assert 'id="charts-grid"' in page
    assert 'data-alias="tiny-dash"' in page
    assert 'data-alias="tiny-off"' not in page
    assert 'data-ws-path="/ws/dashboard"' in page
    assert 'id="playground"' not in page  # chat moved to /dashboard/chat/
    assert 'href="/dashboard/chat/"' in page and 'href="/dashboard/models/"' in page


def test_the_first_paint_shows_the_engines_last_status(staff_client, tiny_enabled):
    """ADM-2, OPS-4: rows come from the cached status before the socket delivers the next one."""
    control.status_publish(
        engine_status(state="loading", status="loading", load_progress={"done": 512, "total": 2048})
    )
    page = staff_client.get(URL).content.decode()
    assert 'data-key="boot-1:7"' in page
    assert "tiny-dash" in page
    assert "1 / 2 / 4" in page
    assert '<progress max="2048" value="512"' in page
    assert "25%" in page
    assert "3 · 62% hits" in page and "1200 prompt tokens saved" in page  # the prefix cache
    assert "disk: 4 · 3.0\xa0MB" in page  # and its disk tier
    assert 'id="initial-status"' in page


def test_the_first_token_time_says_its_queue_wait_and_is_blank_when_unloaded(staff_client, tiny_enabled):
    """ADM-2: the first-token figure includes the queue wait, shown apart, and is not shown stale
    once the weights are gone."""
    control.status_publish(engine_status(ttft_ms=40.5, queue_ms=30.0))
    page = staff_client.get(URL).content.decode()
    assert re.search(r'class="num ttft">40.5 <span class="quiet">\(queue 30.0\)</span>', page)
    control.status_publish(engine_status(state="unloaded", status="unloaded", ttft_ms=40.5, queue_ms=30.0))
    page = staff_client.get(URL).content.decode()
    assert re.search(r'class="num ttft">—</td>', page)


def test_a_failed_load_shows_its_reason(staff_client, tiny_enabled):
    """OPS-4: a failed load is visible with its reason."""
    control.status_publish(engine_status(state="error", status="error", error="config.json is missing"))
    page = staff_client.get(URL).content.decode()
    assert "config.json is missing" in page
    assert "badge-error" in page


@pytest.mark.parametrize(
    ("url", "script"),
    [
        pytest.param(URL, "mlxhost/dashboard.js", id="dashboard"),
        pytest.param("/dashboard/models/", "mlxhost/models.js", id="models"),
    ],
)
def test_every_script_is_served_from_this_site(staff_client, tiny_enabled, url, script):
    """API-5: JavaScript from this site only: no CDN, no inline code or style, a CSP that says so."""
    response = staff_client.get(url)
    page = response.content.decode()
    sources = re.findall(r"<script\b[^>]*\bsrc=\"([^\"]+)\"", page)
    assert any(src.endswith(script) for src in sources)
    if url == URL:
        assert any("vendor/uplot/" in src for src in sources)
    assert all(src.startswith("/static/") for src in sources), sources
    # The only scripts without src are JSON data islands, which are never executed.
    for tag in re.findall(r"<script\b[^>]*>", page):
        assert "src=" in tag or 'type="application/json"' in tag, tag
    assert not re.search(r"\son[a-z]+=", page), "inline event handler"
    assert not re.search(r"\sstyle=", page), "inline style"
    csp = response["Content-Security-Policy"]
    assert "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp


def test_the_page_cannot_be_framed(staff_client):
    """API-5: X-Frame-Options DENY."""
    assert staff_client.get(URL)["X-Frame-Options"] == "DENY"


@pytest.mark.parametrize("url", [URL, "/dashboard/models/"])
def test_every_form_carries_a_csrf_token(staff_client, tiny_enabled, url, django_user_model):
    """API-5: browser pages use Django sessions + CSRF, on every POST form (the Models page's
    action buttons and logout)."""
    from django.contrib.auth.models import Permission

    django_user_model.objects.get(username="ops").user_permissions.add(
        Permission.objects.get(codename="change_model")
    )
    page = staff_client.get(url).content.decode()
    forms = [form for form in re.findall(r"<form\b.*?</form>", page, flags=re.S) if 'method="post"' in form]
    assert forms
    if url != URL:
        assert any('value="load"' in form for form in forms)
    for form in forms:
        assert 'name="csrfmiddlewaretoken"' in form, form[:200]


def test_vendored_chart_library_is_served(staff_client):
    """ADM-2: the charting library comes from static/, with its license."""
    from django.contrib.staticfiles import finders

    assert finders.find("vendor/uplot/uPlot.iife.min.js")
    assert finders.find("vendor/uplot/LICENSE")


@pytest.fixture
def fresh_history(monkeypatch):
    from models_app.console import status_history

    monkeypatch.setattr(status_history, "_last_sample_at", {})
    return status_history


def test_the_server_keeps_an_hour_of_chart_samples(fresh_history):
    """ADM-2: the publisher keeps one sample per engine every 5 s (not each report), an hour of
    them, with only what the charts draw; older ones are dropped."""
    history = fresh_history
    start = time.time() - 2 * history.HISTORY_S
    for second in range(2 * history.HISTORY_S):  # two hours of reports, one a second
        history.history_record({**engine_status(), "at": start + second})
    kept = history.history_of(boot_ids=["boot-1", "boot-gone"], now=start + 2 * history.HISTORY_S)
    assert kept["boot-gone"] == []
    samples = kept["boot-1"]
    assert len(samples) == history.HISTORY_SAMPLES  # the last hour, every 5 s
    assert [b["at"] - a["at"] for a, b in itertools.pairwise(samples)] == [5.0] * (len(samples) - 1)
    assert samples[-1]["at"] == start + 2 * history.HISTORY_S - 5
    assert set(samples[0]["instances"][0]) == set(history.SAMPLE_FIELDS)


def test_a_dashboard_opened_later_gets_the_last_hour(staff_client, tiny_enabled, fresh_history):
    """ADM-2: the page carries the server's samples of every reporting engine, so charts opened
    after an incident show it."""
    now = time.time()
    for ago in (600, 300, 5):
        fresh_history.history_record({**engine_status(queued=ago // 100), "at": now - ago})
    control.status_publish(engine_status())
    page = staff_client.get(URL).content.decode()
    island = re.search(r'<script id="status-history" type="application/json">(.*?)</script>', page, re.S)
    assert island is not None
    history = json.loads(island.group(1))
    assert [round(now - sample["at"]) for sample in history["boot-1"]] == [600, 300, 5]
    assert [sample["instances"][0]["queued"] for sample in history["boot-1"]] == [6, 3, 0]
