"""A fleet on this machine for the fleet tests (issue 15): `deploy.fleet.Fleet` on the test database.

Two daphne engine hosts, an admin-only daphne, a Celery worker and HAProxy with the shipped
`deploy/haproxy.cfg`, all on the PostgreSQL test database and Redis. Without PostgreSQL, Redis or
haproxy the fixture fails, never skips: these tests exist to run the distributed parts for real.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import TYPE_CHECKING

import httpx
import pytest

from deploy.fleet import Fleet
from tests.e2e.conftest import daphne_env, database_url, queue_delete, stored_rows_settle  # noqa: F401
from tests.support import register_alias, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.fleet]


@pytest.fixture(scope="module")
def fleet(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Fleet]:
    with django_db_blocker.unblock():
        url = database_url()
    redis_url = os.environ.get("REDIS_URL", "")
    missing = [
        what
        for what, ok in (
            ("DATABASE_URL on PostgreSQL", url.startswith("postgres")),
            ("REDIS_URL", bool(redis_url)),
            ("haproxy (make haproxy)", shutil.which("haproxy") is not None),
        )
        if not ok
    ]
    if missing:
        pytest.fail(
            f"the fleet tests need {', '.join(missing)}; `make test-fleet` with docs/fleet.md's settings"
        )
    queue = f"mlxhost-fleet-{uuid.uuid4().hex[:12]}"
    env = daphne_env(url, REDIS_URL=redis_url, MLXHOST_CELERY_QUEUE=queue, MLXHOST_SSE_KEEPALIVE_S="1")
    env.pop("MLXHOST_HOST_ID", None)
    running = Fleet(env, tmp_path_factory.mktemp("fleet"))
    try:
        running.start()
        yield running
    except BaseException:
        for proc in running.procs.values():
            print(f"==== {proc.name}\n{proc.output()[-3000:]}")  # noqa: T201 (why the fleet failed)
        raise
    finally:
        running.stop()
        queue_delete(redis_url, queue)


@pytest.fixture
def fleet_alias(fleet: Fleet, tiny_model_dir):
    """The tiny model as `tiny` (greedy), with room for 4 streams per host."""
    alias = register_alias(name="tiny", folder="tiny-llama", temperature=0.0, max_output_tokens=100_000)
    model = alias.model
    model.concurrency, model.queue_depth = 4, 8
    from models_app.catalogue import services

    services.model_save(model=model)
    return alias


def both_hosts_ready(fleet: Fleet) -> None:
    """Wait until HAProxy has both engine hosts in rotation (each answers /readyz 200)."""

    def ready() -> bool:
        return all(httpx.get(f"{fleet.host(n).url}/readyz", timeout=2).status_code == 200 for n in (1, 2))

    wait_until(ready, timeout=30, what="both hosts to be ready")
