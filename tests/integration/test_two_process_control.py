"""ADM-3 across processes: the admin runs here, the engine runs in a daphne process; they share
the database and Redis (channel layer + cache) and nothing else."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import httpx
import pytest
import redis
from django.test import Client

from models_app.catalogue import control, services
from models_app.console.admin import ALIAS_FORM_FIELDS, MODEL_FORM_FIELDS
from tests.e2e.conftest import database_url, running_daphne
from tests.support import register_alias, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from models_app.models import ModelAlias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240), pytest.mark.celery]

CHANGELIST = "/admin/models_app/modelalias/"
MODELS = "/admin/models_app/model/"
NO_INLINE_ALIASES = {
    f"aliases-{k}": "0" for k in ("TOTAL_FORMS", "INITIAL_FORMS", "MIN_NUM_FORMS", "MAX_NUM_FORMS")
}


def wait_for(what: str, probe: Callable[[], object], timeout: float = 60.0) -> object:
    return wait_until(probe, timeout=timeout, interval=0.2, what=what)


@pytest.fixture
def shared_prefix(redis_url: str, settings) -> Iterator[str]:
    """This process and the daphne under test share Redis under a prefix of this test's own."""
    prefix = f"mlxhost-test-{uuid.uuid4().hex[:12]}"
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [{"address": redis_url, "socket_timeout": settings.CHANNEL_LAYER_SOCKET_TIMEOUT_S}],
                "prefix": f"{prefix}:asgi",
            },
        }
    }
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": redis_url,
            "KEY_PREFIX": prefix,
        }
    }
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def _form(row, fields, changes) -> dict:
    data = {}
    for field in fields:
        value = changes.get(field, getattr(row, f"{field}_id" if field == "model" else field))
        if isinstance(value, bool):
            if value:
                data[field] = "on"
            continue
        data[field] = "" if value is None else value
    return data


def admin_edit(client: Client, alias: ModelAlias, **changes) -> None:
    """Save the alias through the admin's change form, as staff would."""
    response = client.post(f"{CHANGELIST}{alias.pk}/change/", _form(alias, ALIAS_FORM_FIELDS, changes))
    assert response.status_code == 302, response.content.decode()[:2000]


def admin_edit_model(client: Client, alias: ModelAlias, **changes) -> None:
    """Save the alias's model (lane, memory, weights) through its admin change form."""
    data = {**_form(alias.model, MODEL_FORM_FIELDS, changes), **NO_INLINE_ALIASES}
    response = client.post(f"{MODELS}{alias.model_id}/change/", data)
    assert response.status_code == 302, response.content.decode()[:2000]


def test_the_admin_here_drives_the_engine_in_another_process(
    shared_prefix, redis_url, tiny_model_dir, tmp_path, django_user_model
):
    """ADM-3, ADM-1, LANE-4: admin actions and edits made in this process reach the engine in the
    daphne process over the channel layer, and its live state comes back through the cache."""
    staff = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    _, key = services.apikey_create(owner=staff, name="probe")
    alias = register_alias(name="tiny", folder="tiny-llama", temperature=0.0)
    admin = Client()
    admin.force_login(staff)

    with running_daphne(
        database_url(), tmp_path, REDIS_URL=redis_url, MLXHOST_SHARED_PREFIX=shared_prefix
    ) as server:

        def readyz() -> list[dict]:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.get(f"{server.url}/readyz", headers=headers, timeout=10).json().get("instances", [])

        def engine_view() -> dict | None:
            return control.instance_views().get(alias.instance_id)

        statuses = wait_for("the engine's status in this process's cache", control.engine_statuses)
        assert [s["pid"] for s in statuses] == [server.process.pid]
        assert readyz() == []  # nothing loaded: the engine only knows what it was told
        # The thing under test: idle for longer than Redis clients' default socket timeout (5 s),
        # which the idle listener must survive.
        time.sleep(6)

        response = admin.post(MODELS, {"action": "load", "_selected_action": [alias.model_id]})
        assert response.status_code == 302
        wait_for("the load", lambda: [i for i in readyz() if i["state"] == "ready"])
        view = wait_for(
            "the resident state in the admin's view",
            lambda: (v := engine_view()) and v["state"] == "ready" and v,
        )
        assert view["aliases"] == ["tiny"]
        assert admin.get(CHANGELIST).status_code == 200 and admin.get(MODELS).status_code == 200

        admin_edit_model(admin, alias, concurrency=3)
        wait_for("the new lane capacity", lambda: readyz()[0]["lane"]["capacity"] == 3)

        response = admin.post(MODELS, {"action": "unload", "_selected_action": [alias.model_id]})
        assert response.status_code == 302
        wait_for("the unload", lambda: readyz()[0]["state"] == "unloaded")

        alias.refresh_from_db()
        admin_edit(admin, alias, enabled=False)
        wait_for("the disabled alias to leave the engine", lambda: readyz() == [])
