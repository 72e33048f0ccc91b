"""/ws/v1/responses through a real daphne process, with a real WebSocket client (`websockets`)."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.support import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/ws/v1/responses"


def open_socket(server, api_key: str, **kwargs) -> ClientConnection:
    return connect(ws_url(server), additional_headers={"Authorization": f"Bearer {api_key}"}, **kwargs)


def frames_until(socket: ClientConnection, *types: str) -> list[dict]:
    seen = []
    while True:
        frame = json.loads(socket.recv(timeout=60))
        seen.append(frame)
        if frame["type"] in types:
            return seen


def create(socket: ClientConnection, **body) -> None:
    socket.send(json.dumps({"type": "response.create", "model": "tiny", **body}))


def lane_of(server, api_key: str) -> dict:
    body = httpx.get(
        f"{server.url}/readyz", headers={"Authorization": f"Bearer {api_key}"}, timeout=10
    ).json()
    return body["instances"][0]["lane"]


def test_two_streamed_turns_on_one_socket(daphne_server, api_key, tiny_alias):
    """API-3: a real client streams two turns back to back; the second continues the first."""
    with open_socket(daphne_server, api_key) as socket:
        create(socket, input="Hello there", max_output_tokens=5)
        first = frames_until(socket, *TERMINAL)
        deltas = [f["delta"] for f in first if f["type"] == "response.output_text.delta"]
        assert first[-1]["type"] == "response.incomplete"
        assert "".join(deltas) == first[-1]["response"]["output"][0]["content"][0]["text"]
        create(
            socket, input="And then?", max_output_tokens=5, previous_response_id=first[-1]["response"]["id"]
        )
        second = frames_until(socket, *TERMINAL)[-1]
        assert second["type"] == "response.incomplete", second
        assert second["response"]["previous_response_id"] == first[-1]["response"]["id"]


def test_queue_position_then_cancel_frees_the_slot(daphne_server, api_key, tiny_alias, tiny_eos_id):
    """API-3, LANE-6: the waiting socket hears its position; a cancel frees the slot (/readyz)."""
    no_eos = {str(tiny_eos_id): -100}
    with open_socket(daphne_server, api_key) as running, open_socket(daphne_server, api_key) as waiting:
        create(running, input="Count", max_output_tokens=100_000, logit_bias=no_eos, store=False)
        frames_until(running, "response.output_text.delta")
        create(waiting, input="Hi", max_output_tokens=3, logit_bias=no_eos, store=False)
        queued = json.loads(waiting.recv(timeout=30))
        assert (queued["type"], queued["position"]) == ("response.queued", 1)

        running.send(json.dumps({"type": "response.cancel"}))
        assert frames_until(running, *TERMINAL)[-1]["response"]["status"] == "cancelled"
        assert frames_until(waiting, *TERMINAL)[-1]["response"]["usage"]["output_tokens"] == 3
    assert lane_of(daphne_server, api_key)["active"] == 0


def test_closing_the_socket_frees_the_slot(daphne_server, api_key, tiny_alias, tiny_eos_id):
    """API-3, LANE-6: hanging up mid-stream cancels the turn on the server."""
    with open_socket(daphne_server, api_key) as socket:
        create(
            socket, input="Count", max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100}, store=False
        )
        frames_until(socket, "response.output_text.delta")
    wait_until(lambda: lane_of(daphne_server, api_key)["active"] == 0, what="the slot to be freed")


def test_a_foreign_origin_and_missing_credentials_are_refused(daphne_server, api_key, tiny_alias):
    """API-5: daphne turns a close before accept into a refused handshake (HTTP 403)."""
    with pytest.raises(InvalidStatus) as foreign:
        open_socket(daphne_server, api_key, origin="https://evil.example")
    assert foreign.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as anonymous:
        connect(ws_url(daphne_server))
    assert anonymous.value.response.status_code == 403
    with open_socket(daphne_server, api_key, origin=daphne_server.url) as same_site:
        create(same_site, input="Hi", max_output_tokens=2, store=False)
        assert frames_until(same_site, *TERMINAL)[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("extra", [pytest.param(1, id="just-over"), pytest.param(3 << 20, id="far-over")])
def test_a_frame_over_the_limit_closes_with_1009_through_daphne(daphne_server, api_key, tiny_alias, extra):
    """API-3: daphne's own message cap used to drop the TCP connection (the client saw 1006);
    a frame over MLXHOST_WS_MAX_FRAME_BYTES (1 MiB) now closes with 1009."""
    from django.conf import settings
    from websockets.exceptions import ConnectionClosed

    with open_socket(daphne_server, api_key) as socket:
        head = '{"type": "response.create", "model": "tiny", "input": "'
        filler = "x" * (settings.MLXHOST_WS_MAX_FRAME_BYTES - len(head) - 2 + extra)
        socket.send(head + filler + '"}')
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


UPGRADE = (
    "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


def raw_status(server, request: str) -> tuple[str, dict[str, str]]:
    """The status line and headers daphne answers a raw `request` with."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(request.replace("HOST", f"{url.hostname}:{url.port}").encode())
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := conn.recv(65536)):
            answer += chunk
    status, *lines = answer.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    return status, {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_an_upgrade_with_another_method_than_get_is_a_405_that_allows_get(daphne_server, method):
    """RFC 9110: the WebSocket handshake is refused below Django (autobahn) with a 405; it
    carries `Allow: GET`."""
    status, headers = raw_status(
        daphne_server,
        f"{method} /ws/v1/responses HTTP/1.1\r\nHost: HOST\r\n{UPGRADE}Content-Length: 0\r\n\r\n",
    )
    assert status.startswith("HTTP/1.1 405 ")
    assert headers["allow"] == "GET"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/nothing"])
def test_an_upgrade_to_a_path_without_a_socket_is_refused_not_a_500(daphne_server, path):
    """API-4: Channels raised "No route found" (a 500 and a traceback); the handshake is refused."""
    status, _ = raw_status(daphne_server, f"GET {path} HTTP/1.1\r\nHost: HOST\r\n{UPGRADE}\r\n")
    assert status.startswith("HTTP/1.1 403 ")
