"""End to end: SIGTERM drains a real daphne process, ends every open stream, and exits 0 (OPS-5)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import Server, database_url, running_daphne
from tests.support import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

SHUTDOWN_TIMEOUT_S = 2
# Generous bounds, never timings: the stream must end and the process exit well within these.
STREAM_END_WITHIN_S = 60
EXIT_WITHIN_S = 60
HELLO = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture
def server(django_db_setup, django_db_blocker, tmp_path) -> Iterator[Server]:
    """A daphne of this test's own: the test stops it."""
    with django_db_blocker.unblock():
        url = database_url()
    with running_daphne(url, tmp_path, MLXHOST_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_TIMEOUT_S)) as server:
        yield server


class StreamReader(threading.Thread):
    """Reads one SSE response line by line on a thread; `lines` grows as data arrives."""

    def __init__(self, url: str, headers: dict[str, str], body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.headers, self.body = url, headers, body
        self.lines: list[str] = []
        self.status = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client,
                client.stream("POST", self.url, json=self.body, headers=self.headers) as response,
            ):
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
        except BaseException as exc:  # reported by the test, not lost on the thread
            self.error = exc

    def data(self) -> list[str]:
        return [line.removeprefix("data: ") for line in self.lines if line.startswith("data: ")]

    @property
    def ended(self) -> bool:
        return "[DONE]" in self.data()


def lane(server: Server, headers: dict[str, str]) -> dict:
    instances = httpx.get(f"{server.url}/readyz", headers=headers, timeout=10).json().get("instances", [])
    return instances[0]["lane"] if instances else {}


def test_sigterm_drains_ends_every_stream_and_exits_zero(server, tiny_alias, api_key, tiny_eos_id):
    """OPS-5, LANE-7: on SIGTERM the running stream gets SHUTDOWN_TIMEOUT_S to finish, is then
    aborted and ends with a final chunk whose finish_reason is `abort` (never one that reads like
    a complete answer), an error event (code `draining`) and [DONE]; the queued request and a new
    one sent during the drain get 503 `draining`; then the process exits with status 0."""
    headers = {"Authorization": f"Bearer {api_key}"}
    chat = f"{server.url}/v1/chat/completions"
    no_eos = {str(tiny_eos_id): -100}
    stream = StreamReader(
        chat,
        headers,
        {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 1_000_000, "logit_bias": no_eos},
    )
    stream.start()
    wait_until(
        lambda: len(stream.data()) >= 5 or stream.error is not None,
        timeout=60,
        interval=0.02,
        what="the stream's first chunks",
    )
    assert stream.error is None and stream.status == 200

    queued: dict[str, httpx.Response] = {}
    waiter = threading.Thread(
        target=lambda: queued.setdefault(
            "response",
            httpx.post(
                chat, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, headers=headers, timeout=120
            ),
        ),
        daemon=True,
    )
    waiter.start()
    wait_until(
        lambda: lane(server, headers).get("queued") == 1,
        timeout=60,
        interval=0.02,
        what="the second request to queue",
    )

    server.process.send_signal(signal.SIGTERM)
    wait_until(
        lambda: lane(server, headers).get("draining") is True,
        timeout=60,
        interval=0.02,
        what="the drain to start",
    )
    assert not stream.ended, "the stream must still be running while the drain refuses arrivals"
    late = httpx.post(
        chat, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, headers=headers, timeout=30
    )
    assert late.status_code == 503
    assert late.json()["error"]["code"] == "draining"
    assert int(late.headers["Retry-After"]) >= 1

    waiter.join(STREAM_END_WITHIN_S)
    assert queued["response"].status_code == 503
    assert queued["response"].json()["error"]["code"] == "draining"

    stream.join(STREAM_END_WITHIN_S)
    assert not stream.is_alive(), "the open stream hung"
    assert stream.error is None, stream.error
    data = stream.data()
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "draining"
    finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, data[:-2]) if c.get("choices")]
    assert finishes[-1] == "abort" and all(f is None for f in finishes[:-1])

    assert server.process.wait(timeout=EXIT_WITHIN_S) == 0, server.output()
    assert "engine stopped" in server.output()
    # Issue 25: a stream that outlives daphne's cancel of its request task leaves no orphaned
    # RequestAborted behind, and the log holds no traceback at all.
    assert "Task exception was never retrieved" not in server.output(), server.output()
    assert "Traceback" not in server.output(), server.output()


def test_sigterm_ends_a_running_websocket_turn_with_its_terminal_event(
    server, tiny_alias, api_key, tiny_eos_id
):
    """OPS-5, API-3: a WebSocket turn still generating when SIGTERM arrives (it never ends by
    itself) gets its terminal event after the drain's grace period: `response.incomplete`, reason
    `draining`, never `completed`; the socket then closes with 1001, as does an idle one, and the
    process exits 0."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = server.url.replace("http://", "ws://") + "/ws/v1/responses"
    auth = {"Authorization": f"Bearer {api_key}"}
    # A second socket that never starts a turn must hear 1001 too, never 1006 (issue 25).
    with connect(url, additional_headers=auth) as idle, connect(url, additional_headers=auth) as socket:
        socket.send(
            json.dumps(
                {
                    "type": "response.create",
                    "model": "tiny",
                    "input": "Tell me a long story",
                    "max_output_tokens": 1_000_000,
                    "logit_bias": {str(tiny_eos_id): -100},
                }
            )
        )
        frames = [json.loads(socket.recv(timeout=60)) for _ in range(6)]
        assert sum(f["type"] == "response.output_text.delta" for f in frames) >= 1, frames

        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STREAM_END_WITHIN_S
        while frames[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed"):
            assert time.monotonic() < deadline, "the turn never ended"
            frames.append(json.loads(socket.recv(timeout=STREAM_END_WITHIN_S)))
        assert frames[-1]["type"] == "response.incomplete", frames[-1]
        assert frames[-1]["response"]["status"] == "incomplete"
        assert frames[-1]["response"]["incomplete_details"] == {"reason": "draining"}
        with pytest.raises(ConnectionClosed) as closed:
            while True:  # nothing but the close may follow the terminal event
                extra = json.loads(socket.recv(timeout=STREAM_END_WITHIN_S))
                assert extra["type"] not in ("response.output_text.delta",), extra
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001, server.output()
        with pytest.raises(ConnectionClosed) as idle_closed:
            idle.recv(timeout=STREAM_END_WITHIN_S)
        assert idle_closed.value.rcvd is not None and idle_closed.value.rcvd.code == 1001, server.output()

    assert server.process.wait(timeout=EXIT_WITHIN_S) == 0, server.output()


PATIENT_SHUTDOWN_S = 120  # far longer than the test: a turn still running at exit was not cancelled


@pytest.fixture
def patient_server(django_db_setup, django_db_blocker, tmp_path) -> Iterator[Server]:
    """A daphne whose drain would wait PATIENT_SHUTDOWN_S for running turns."""
    with django_db_blocker.unblock():
        url = database_url()
    with running_daphne(url, tmp_path, MLXHOST_SHUTDOWN_TIMEOUT_S=str(PATIENT_SHUTDOWN_S)) as server:
        yield server


def raw_post(server: Server, headers: dict[str, str], body: dict) -> socket.socket:
    """POST `body` on a socket of its own, left open: closing it is the client leaving."""
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    return sock


@contextlib.contextmanager
def failing_with_the_log(server) -> Iterator[None]:
    """A failed check inside says what the server logged (the end of it)."""
    try:
        yield
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n--- server log ---\n{server.output()[-6000:]}") from None


def test_clients_that_leave_during_the_drain_cancel_their_turns(
    patient_server, tiny_alias, api_key, tiny_eos_id
):
    """Issue 25 (Ctrl-C under load): once SIGTERM has started the drain, a streamed and a plain
    turn whose clients then hang up are cancelled as any client's leaving cancels (LANE-6), not
    generated for nobody until the drain timeout: each request's log line says `cancelled`,
    and the process exits 0 with the drain timeout far from spent."""
    from models_app.catalogue import services

    model = tiny_alias.model
    model.concurrency = 2
    services.model_save(model=model)
    server = patient_server
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 1_000_000,
        "logit_bias": {str(tiny_eos_id): -100},
    }
    with failing_with_the_log(server):
        wait_until(
            lambda: lane(server, headers).get("capacity") == 2 or lane(server, headers) == {}, timeout=30
        )
        streamed = raw_post(server, headers, {**body, "stream": True})
        assert b"200 OK" in streamed.recv(4096)  # the stream's headers: it runs
        plain = raw_post(server, headers, body)
        wait_until(
            lambda: lane(server, headers).get("active") == 2,
            timeout=60,
            interval=0.05,
            what="both turns to run",
        )

        server.process.send_signal(signal.SIGTERM)
        wait_until(
            lambda: "draining the engine" in server.output(), timeout=60, interval=0.05, what="the drain"
        )
    streamed.close()
    plain.close()

    assert server.process.wait(timeout=PATIENT_SHUTDOWN_S / 2) == 0, server.output()
    lines = [line for line in server.output().splitlines() if "path=/v1/chat/completions" in line]
    # The whole log on failure: a rare failure here (1 run in many) has not been read yet.
    assert len(lines) == 2 and all("outcome=cancelled" in line for line in lines), server.output()[-6000:]
    assert "Traceback" not in server.output()


def test_websocket_clients_that_leave_during_the_drain_cancel_their_turns(
    patient_server, tiny_alias, api_key, tiny_eos_id
):
    """Issue 25: as with HTTP above, once SIGTERM has started the drain, WebSocket turns whose
    clients then close their sockets are cancelled at once (API-3, LANE-6): daphne's cancel of
    every consumer at shutdown no longer leaves their disconnect unread, so each turn's log line
    says `cancelled` long before the drain timeout, and the process exits 0."""
    from websockets.sync.client import connect

    from models_app.catalogue import services

    model = tiny_alias.model
    model.concurrency = 2
    services.model_save(model=model)
    server = patient_server
    headers = {"Authorization": f"Bearer {api_key}"}
    wait_until(lambda: lane(server, headers).get("capacity") == 2 or lane(server, headers) == {}, timeout=30)
    url = server.url.replace("http://", "ws://") + "/ws/v1/responses"
    create = {
        "type": "response.create",
        "model": "tiny",
        "input": "Tell me a long story",
        "max_output_tokens": 1_000_000,
        "logit_bias": {str(tiny_eos_id): -100},
    }
    sockets = [connect(url, additional_headers=headers) for _ in range(2)]
    for socket_ in sockets:
        socket_.send(json.dumps(create))
    for socket_ in sockets:  # each turn is generating
        while json.loads(socket_.recv(timeout=60))["type"] != "response.output_text.delta":
            pass
    wait_until(
        lambda: lane(server, headers).get("active") == 2, timeout=60, interval=0.05, what="both turns to run"
    )

    server.process.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining the engine" in server.output(), timeout=60, interval=0.05, what="the drain")
    for socket_ in sockets:
        socket_.close()

    def ws_lines() -> list[str]:
        return [line for line in server.output().splitlines() if "path=/ws/v1/responses" in line]

    # Without the cancel the turns run on until the drain timeout (PATIENT_SHUTDOWN_S) ends them.
    wait_until(lambda: len(ws_lines()) == 2, timeout=PATIENT_SHUTDOWN_S / 4, what="both turns to end")
    assert all("outcome=cancelled" in line for line in ws_lines()), ws_lines()
    assert server.process.wait(timeout=PATIENT_SHUTDOWN_S / 2) == 0, server.output()
    assert "Traceback" not in server.output()
