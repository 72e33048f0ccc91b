"""A real daphne process serving mlxhost against the test database, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

import httpx
import pytest
from django.db import DatabaseError, connection

from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def database_url() -> str:
    """A URL for the test database that pytest-django created, so daphne sees the tests' rows."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = db.get("USER") or "postgres"
    host, port = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(server: Server, timeout: float = 60.0) -> None:
    def up() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(f"daphne exited early:\n{server.output()}")
        try:
            return httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=timeout, interval=0.2, what="daphne to come up")
    except AssertionError as timed_out:
        raise RuntimeError(f"{timed_out}:\n{server.output()}") from None


def endless(eos_id: int, **body: object) -> dict:
    """A streamed request body for `tiny` that never says end-of-sequence: it runs until cancelled
    (or its token budget, which `body` gives, runs out)."""
    return {"model": "tiny", "stream": True, "logit_bias": {str(eos_id): -100}, **body}


@contextlib.contextmanager
def holding_stream(server: Server, api_key: str, path: str, body: dict) -> Iterator[httpx.Response]:
    """A streaming POST to `path` that stays open for the block; on leaving it the client hangs up."""
    headers = {"Authorization": f"Bearer {api_key}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}{path}", json=body, headers=headers) as response,
    ):
        yield response


def instance_snapshot(server: Server, alias: str, api_key: str) -> dict:
    """The `/readyz` view of the instance serving `alias`."""
    # By alias: the server process keeps its instance ids while the test database is rebuilt.
    headers = {"Authorization": f"Bearer {api_key}"}
    body = httpx.get(f"{server.url}/readyz", headers=headers, timeout=5).json()
    return next(i for i in body["instances"] if alias in i["aliases"])


def set_lane(server: Server, api_key: str, alias, *, concurrency: int, queue_depth: int) -> None:
    """Edit the lane of `alias`'s model as the admin does, then wait until the server's engine
    serves it with that lane: its control plane re-reads the database (MLXHOST_RECONCILE_INTERVAL_S)
    when no channel layer carries the change from this process."""
    from models_app.catalogue import services

    model = alias.model
    model.concurrency, model.queue_depth = concurrency, queue_depth
    services.model_save(model=model)

    def applied() -> bool:
        try:
            lane = instance_snapshot(server, alias.name, api_key)["lane"]
        except StopIteration:
            return True  # not bound there yet: its first request binds it from the new row
        return (lane["capacity"], lane["limit"]) == (concurrency, concurrency + queue_depth)

    wait_until(applied, timeout=30, what=f"the server to serve {alias.name} with the new lane")


@pytest.fixture(scope="module")
def daphne_server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Server]:
    with django_db_blocker.unblock():
        url = database_url()
    with running_daphne(url, tmp_path_factory.mktemp("daphne")) as server:
        yield server


@contextlib.contextmanager
def running_daphne(database: str, log_dir: Path, **env_extra: str) -> Iterator[Server]:
    """daphne serving mlxhost on a free port against `database`, stopped on exit.

    With REDIS_URL (in the environment or `env_extra`) a Celery worker runs beside it, so stored
    responses go through a real broker, as in production.
    """
    env = daphne_env(database, **env_extra)
    log = log_dir / "daphne.log"
    worker = celery_worker(env, log.with_name("celery.log")) if env.get("REDIS_URL") else None
    server = spawn_daphne(env, log)
    try:
        wait_until_up(server)
        yield server
    finally:
        for proc in (server.process, worker):
            if proc is not None:
                stop_process(proc)
        if worker is not None:
            queue_delete(env["REDIS_URL"], env["MLXHOST_CELERY_QUEUE"])


def daphne_env(database: str, **env_extra: str) -> dict[str, str]:
    """The environment of a test daphne (and its Celery worker): the test database and models."""
    from django.conf import settings

    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
        "DATABASE_URL": database,
        "MODELS_ROOT": str(settings.MODELS_ROOT),
        "MLXHOST_PRELOAD": "false",
        "PYTHONUNBUFFERED": "1",
        # A queue of this server's own, so concurrent runs on one Redis never share tasks.
        "MLXHOST_CELERY_QUEUE": f"mlxhost-e2e-{uuid.uuid4().hex[:12]}",
        **env_extra,
    }


def spawn_daphne(env: dict[str, str], log: Path) -> Server:
    """Start daphne on a free port with `env`; the caller waits for it (`wait_until_up`) and stops it."""
    port = free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "mlxhost.asgi:application"],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    return Server(url=f"http://127.0.0.1:{port}", process=process, log=log)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s; a process that already exited is left alone."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def queue_delete(redis_url: str, queue: str) -> None:
    """Drop a test queue's keys, so runs leave no litter in a shared Redis."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    client.close()


def celery_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    """`celery -A mlxhost.celery worker` on the server's queue, started and ready."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "mlxhost.celery",
                "worker",
                "--pool=solo",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"celery worker exited:\n{log.read_text(errors='replace')}")
        return " ready." in log.read_text(errors="replace")

    try:
        wait_until(ready, timeout=60, interval=0.1, what="the celery worker to start")
    except BaseException as failed:
        process.kill()
        raise RuntimeError(f"{failed}:\n{log.read_text(errors='replace')}") from None
    return process


@pytest.fixture(autouse=True)
def stored_rows_settle(transactional_db) -> Iterator[None]:
    """After each test, wait until the server's stored responses stop landing.

    The daphne process (and, with Redis, a Celery worker) writes rows after the client has its
    answer; a write that meets the test database's TRUNCATE deadlocks PostgreSQL. Torn down
    before `transactional_db` flushes, because it depends on it.
    """
    yield
    from models_app.models import StoredResponse

    flush_outwaits_the_server()

    deadline, last, stable_since = time.monotonic() + 15, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = StoredResponse.objects.count()
        if count != last:
            last, stable_since = count, time.monotonic()
        elif time.monotonic() - stable_since >= 1.0:
            return
        time.sleep(0.1)  # a quiet period is the condition itself: the count unchanged for 1 s


def flush_outwaits_the_server() -> None:
    """On PostgreSQL, make the flush after a test outwait the server's reads in a deadlock.

    The server keeps reading (its periodic reconcile joins aliases to models, the live pages read
    them too); a read that takes its locks while the flush's TRUNCATE takes its own, in the other
    order, deadlocks. The backend whose deadlock_timeout runs out first finds the cycle and fails
    itself: with the flush's the longer, the server's read fails (and is tried again next round),
    never the flush, which would leave the rows to the next test. Setting it needs a superuser;
    without one the default stands.
    """
    if connection.vendor != "postgresql":
        return
    with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SET deadlock_timeout = '10s'")
