"""Deployment baseline and browser hardening: login throttle, CSP on every page, `check --deploy`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from mlxhost.security import DEFAULT_CSP

ROOT = Path(__file__).resolve().parent.parent
LOGIN = "/admin/login/"
PASSWORD = "pw-root-123"


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(
        username="root", password=PASSWORD, is_staff=True, is_superuser=True
    )


def log_in(client, password: str, username: str = "root", **extra):
    return client.post(LOGIN, {"username": username, "password": password, "next": "/admin/"}, **extra)


def logged_in(client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.django_db
def test_six_failed_admin_logins_lock_out_the_seventh_even_with_the_right_password(client, staff):
    """ADM-1: the admin login is throttled (django-axes): 5 failures for one username from one
    address lock the pair out; the right password is then refused too."""
    for _ in range(6):
        assert log_in(client, "wrong-password").status_code in (200, 429)
    locked = log_in(client, PASSWORD)
    assert locked.status_code == 429
    assert not logged_in(client)
    # Another address is not locked out for this username (the lock is username + address).
    other = log_in(client.__class__(), PASSWORD, REMOTE_ADDR="10.9.8.7")
    assert other.status_code == 302


@pytest.mark.django_db
def test_a_successful_login_resets_the_failure_count(client, staff):
    """ADM-1: failures below the limit are forgotten after a successful login."""
    for _ in range(4):
        log_in(client, "wrong-password")
    assert log_in(client, PASSWORD).status_code == 302
    client.logout()
    for _ in range(4):
        log_in(client, "wrong-password")
    assert log_in(client, PASSWORD).status_code == 302
    assert logged_in(client)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(LOGIN, id="login"),
        pytest.param("/admin/", id="index"),
        pytest.param("/admin/models_app/modelalias/", id="changelist"),
        pytest.param("/admin/models_app/modelalias/add/", id="change-form"),
        pytest.param("/dashboard/", id="dashboard"),
    ],
)
def test_every_html_page_sends_a_content_security_policy(client, staff, path):
    """API-5: the admin pages carry a strict CSP too (the dashboard keeps its own, with sockets)."""
    if path != LOGIN:
        client.force_login(staff)
    response = client.get(path)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    csp = response["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    if path == "/dashboard/":
        assert "connect-src" in csp  # its own policy, not replaced by the default
    else:
        assert csp == DEFAULT_CSP
        # Nothing the default policy would block: every script is loaded by src.
        assert b"<script>" not in response.content


ADMIN_LINK = re.compile(r'href="(/admin/[^"#?]*)')


def assert_policy(response, path: str) -> None:
    """An HTML answer carries the page policy: the default, or the dashboard's own."""
    assert response.status_code < 500, path
    if not response.get("Content-Type", "").startswith("text/html"):
        return
    csp = response.get("Content-Security-Policy")
    assert csp, f"{path} ({response.status_code}) has no Content-Security-Policy"
    if path.startswith("/dashboard/"):
        assert "connect-src" in csp and "script-src 'self'" in csp
    else:
        assert csp == DEFAULT_CSP, path
        assert b"<script>" not in response.content, path  # every script by src: nothing blocked


def walk_admin(client, start: list[str], limit: int = 400) -> list[str]:
    """Every admin page reachable by links from `start` (breadth first), each checked; returns them."""
    seen: list[str] = []
    queue = list(start)
    while queue and len(seen) < limit:
        path = queue.pop(0)
        if path in seen or path.endswith("/logout/"):
            continue
        seen.append(path)
        response = client.get(path)
        assert_policy(response, path)
        if response.get("Content-Type", "").startswith("text/html"):
            queue += [link for link in ADMIN_LINK.findall(response.content.decode()) if link not in seen]
    return seen


@pytest.mark.django_db
def test_every_admin_page_and_the_dashboard_send_the_policy(client, staff, tiny_alias, user):
    """OPS-7: every page the admin links to (walked from its index: changelists, add, change,
    history and delete pages of every model, the chain view, the password pages), the dashboard,
    and the pages answered before any view (a CSRF failure, a bad Host, a missing slash, a lockout,
    the logout page, an action's confirmation, a 404) carry the Content-Security-Policy."""
    from django.test import Client

    from models_app.catalogue import services
    from models_app.models import InstanceTombstone, StoredResponse

    key, _ = services.apikey_create(owner=user, name="walked")
    StoredResponse.objects.create(
        public_id="resp_walk", owner=user, alias=tiny_alias, alias_name="tiny", instance_id=1,
        weights_fingerprint="f" * 64, boot_id="b", expires_at=timezone.now() + timedelta(days=1),
    )  # fmt: skip
    InstanceTombstone.objects.create(
        instance_id=9, source="tiny-llama", fingerprint="f" * 64, response_public_id="resp_t",
        expires_at=timezone.now() + timedelta(days=1),
    )  # fmt: skip
    client.force_login(staff)
    walked = walk_admin(client, ["/admin/", "/dashboard/"])
    for must in (
        f"/admin/models_app/model/{tiny_alias.model_id}/history/",
        f"/admin/models_app/modelalias/{tiny_alias.pk}/delete/",
        f"/admin/models_app/apikey/{key.pk}/change/",
        "/admin/models_app/storedresponse/",
        "/admin/models_app/instancetombstone/",
        "/admin/auth/user/add/",
        "/admin/password_change/",
    ):
        assert must in walked, must
    assert len(walked) > 40

    early = {
        "missing slash": client.get("/admin"),
        "bad host": client.get("/admin/", headers={"host": "evil.example"}),
        "not found": client.get("/admin/models_app/nothing-here/"),
        "page not found": client.get("/no-such-page/"),
        "action confirmation": client.post(
            "/admin/models_app/apikey/", {"action": "delete_selected", "_selected_action": [key.pk]}
        ),
        "anonymous": Client().get("/admin/"),
        "login": Client().get(LOGIN),
        "csrf failure": Client(enforce_csrf_checks=True).post(LOGIN, {"username": "root", "password": "x"}),
    }
    for _ in range(6):
        early["lockout"] = log_in(Client(), "wrong-password")
    early["logged out"] = client.post("/admin/logout/")
    assert early["csrf failure"].status_code == 403 and early["lockout"].status_code == 429
    assert early["bad host"].status_code == 400
    for name, response in early.items():
        assert_policy(response, name)
        if name in ("csrf failure", "lockout", "bad host", "logged out", "action confirmation", "not found"):
            assert response["Content-Security-Policy"] == DEFAULT_CSP, name


def test_json_responses_get_no_page_policy(client):
    assert "Content-Security-Policy" not in client.get("/healthz")


DEPLOY_SCRIPT = """
import django
django.setup()
from django.core.management import call_command
from django.test import Client
call_command("check", deploy=True, fail_level="WARNING")
client = Client()
health = client.get("/healthz")
login = client.get("/admin/login/")
secure = client.get("/admin/login/", headers={"X-Forwarded-Proto": "https"})
print(health.status_code, login.status_code, login.get("Location"), secure.status_code,
      secure["Strict-Transport-Security"], secure.cookies["csrftoken"]["secure"], sep="|")
"""


def test_check_deploy_is_clean_behind_a_tls_proxy(tmp_path):
    """With MLXHOST_BEHIND_TLS_PROXY=true `check --deploy` has no warning; plain HTTP is
    redirected to https except the health probes, and cookies are Secure."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "MLXHOST_", "SECRET_KEY"))},
        "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
        "MLXHOST_BEHIND_TLS_PROXY": "true",
        "MLXHOST_VAR_DIR": str(tmp_path),
        "MLXHOST_RUN_ENGINE": "false",
        "DJANGO_ALLOWED_HOSTS": "testserver",
    }
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", DEPLOY_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout
    health, login, location, secure, hsts, cookie_secure = done.stdout.splitlines()[-1].split("|")
    assert (health, login, location, secure) == ("200", "301", "https://testserver/admin/login/", "200")
    assert hsts == "max-age=31536000; includeSubDomains; preload"
    assert cookie_secure == "True"


def test_local_http_is_unchanged_without_the_proxy_setting(client, settings):
    """Unset (local http://127.0.0.1): no redirect, no Secure-only cookies."""
    assert not settings.MLXHOST_BEHIND_TLS_PROXY
    assert (settings.SECURE_SSL_REDIRECT, settings.SESSION_COOKIE_SECURE) == (False, False)
    assert client.get(LOGIN).status_code == 200


def test_the_protection_check_stands_in_for_djangos_silenced_ones(settings):
    """API-5: Django's path-based W001-W003 are silenced for our subclasses; our own check still warns when one is gone."""
    from mlxhost.middleware import check_protections

    assert check_protections() == []
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if "Csrf" not in m and "XFrame" not in m]
    assert sorted(w.id for w in check_protections()) == ["mlxhost.W002", "mlxhost.W003"]
