"""Chaos: SIGKILL a real daphne the moment a client gets its terminal event; no delivered turn is lost.

With REDIS_URL and DATABASE_URL set (CI) the turns go through Redis to a real Celery worker and
land in PostgreSQL; otherwise the embedded default writes them inline into SQLite.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import (
    Server,
    celery_worker,
    daphne_env,
    database_url,
    queue_delete,
    spawn_daphne,
    stop_process,
    wait_until_up,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ROUNDS = 5
STREAMS = 4  # concurrent streams per round
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
LAND_WITHIN_S = 30.0  # a published task still has to reach the worker after the restart


class KillableServers:
    """Starts daphne against the test database again and again; a worker (with Redis) outlives them."""

    def __init__(self, database: str, log_dir: Path) -> None:
        self.env = daphne_env(database)
        self.log_dir = log_dir
        self.started: list[Server] = []
        self.worker = celery_worker(self.env, log_dir / "celery.log") if self.env.get("REDIS_URL") else None

    def start(self) -> Server:
        server = spawn_daphne(self.env, self.log_dir / f"daphne-{len(self.started)}.log")
        self.started.append(server)
        wait_until_up(server)
        return server

    def close(self) -> None:
        for server in self.started:
            stop_process(server.process)
        if self.worker is not None:
            stop_process(self.worker)
            queue_delete(self.env["REDIS_URL"], self.env["MLXHOST_CELERY_QUEUE"])


@pytest.fixture
def servers(django_db_setup, django_db_blocker, tmp_path) -> Iterator[KillableServers]:
    with django_db_blocker.unblock():
        url = database_url()
    killable = KillableServers(url, tmp_path)
    try:
        yield killable
    finally:
        killable.close()


class Stream(threading.Thread):
    """One streamed, stored Responses turn; calls `on_terminal` the moment its final event is parsed."""

    def __init__(self, server: Server, headers: dict[str, str], body: dict, on_terminal: Callable) -> None:
        super().__init__(daemon=True)
        self.server, self.headers, self.body, self.on_terminal = server, headers, body, on_terminal
        self.terminal: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        url = f"{self.server.url}/v1/responses"
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client,
                client.stream("POST", url, json=self.body, headers=self.headers) as response,
            ):
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if event["type"] in TERMINAL:
                        self.terminal = event["response"]
                        self.on_terminal()
                        return
        except httpx.HTTPError as exc:  # the server was killed under this stream: expected
            self.error = exc


def run_round(server: Server, headers: dict[str, str], kill_after: int) -> list[dict]:
    """STREAMS concurrent stored turns; SIGKILL the server when `kill_after` clients have their
    terminal event. Returns the terminal `response` objects the clients received."""
    lock, received = threading.Lock(), []

    def on_terminal() -> None:
        with lock:
            received.append(1)
            if len(received) == kill_after:
                os.kill(server.process.pid, signal.SIGKILL)

    streams = [
        Stream(
            server,
            headers,
            {"model": "tiny", "input": f"turn {i}", "max_output_tokens": 4 + 6 * i, "stream": True},
            on_terminal,
        )
        for i in range(STREAMS)
    ]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join(timeout=180)
        assert not stream.is_alive(), "a stream neither ended nor broke"
    server.process.wait(timeout=30)
    # Every stream either got its terminal event or was cut by the kill; nothing else went wrong.
    assert all(s.terminal is not None or isinstance(s.error, httpx.HTTPError) for s in streams)
    return [s.terminal for s in streams if s.terminal is not None]


def fetch_landed(server: Server, headers: dict[str, str], response_id: str) -> dict:
    """GET the stored response, waiting (bounded) while a published task is still on its way."""
    deadline = time.monotonic() + LAND_WITHIN_S
    while True:
        got = httpx.get(f"{server.url}/v1/responses/{response_id}", headers=headers, timeout=10)
        if got.status_code == 200 or time.monotonic() > deadline:
            return {"status_code": got.status_code, **got.json()}
        time.sleep(0.1)  # poll interval: the caller asserts on the last answer, landed or not


def output_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] for part in item["content"])


def test_a_turn_whose_final_event_was_delivered_survives_sigkill(servers, tiny_alias, api_key):
    """PER-1, PER-3 (issue 10 item 5): over several rounds of concurrent streamed stored turns,
    the server is SIGKILLed the moment the 1st, 2nd or 3rd client receives its terminal event.
    After a restart every delivered turn is a complete row with the text the client saw, and no
    row is in progress or inconsistent."""
    from models_app.models import StoredResponse

    headers = {"Authorization": f"Bearer {api_key}"}
    delivered: list[dict] = []
    server = servers.start()
    for round_ in range(ROUNDS):
        delivered += run_round(server, headers, kill_after=1 + round_ % 3)
        server = servers.start()
    assert len(delivered) >= ROUNDS  # at least the turn that triggered each kill

    for turn in delivered:
        stored = fetch_landed(server, headers, turn["id"])
        assert stored["status_code"] == 200, f"turn {turn['id']} was delivered but lost: {stored}"
        assert stored["status"] == turn["status"]
        assert output_text(stored) == output_text(turn)
        assert stored["usage"] == turn["usage"]

    terminal = {"completed", "incomplete", "failed", "cancelled"}
    for row in StoredResponse.objects.all():
        assert row.status in terminal, f"{row.public_id} left {row.status}"
        if row.status != "failed":
            assert output_text({"output": row.output}) == row.output_text, row.public_id
