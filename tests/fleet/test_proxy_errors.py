"""The shipped `deploy/haproxy.cfg` in front of stand-in hosts: HAProxy's own errors carry the
OpenAI error envelope, and a request is retried where that is safe. No PostgreSQL or daphne: a
host here is a socket that answers or hangs up, which is all HAProxy sees of a dying host."""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import subprocess
import threading
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from deploy.fleet import HAPROXY_CFG, free_port
from tests.support import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(120)]

ERRORS = HAPROXY_CFG.parent / "errors"


class Host(socketserver.ThreadingTCPServer):
    """A stand-in engine host: /readyz answers 200 (so HAProxy keeps it in rotation); any other
    request is recorded and, while `hang_ups` is above zero, answered by closing the connection
    without a byte (a host dying after it read the request), else by 200."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hang_ups = 0
        self.seen: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Handler(socketserver.StreamRequestHandler):
    server: Host

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.request.recv(65536)
            if not chunk:
                return
            head += chunk
        request_line = head.split(b"\r\n", 1)[0].decode()
        method, path = request_line.split(" ")[:2]
        if not path.startswith("/readyz"):
            with self.server.lock:
                self.server.seen.append(f"{method} {path}")
                if self.server.hang_ups > 0:
                    self.server.hang_ups -= 1
                    self.request.shutdown(socket.SHUT_RDWR)
                    return
        body = b'{"ok": true}'
        self.request.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Any]:
    """Start HAProxy on the shipped config with the given host addresses; stopped after."""
    if shutil.which("haproxy") is None:
        pytest.fail("the proxy tests need haproxy (make haproxy)")
    started: list[subprocess.Popen[bytes]] = []

    def start(h01: str, h02: str) -> str:
        port = free_port()
        env = {
            **os.environ,
            "MLXHOST_FLEET_BIND": f"127.0.0.1:{port}",
            "MLXHOST_FLEET_H01": h01,
            "MLXHOST_FLEET_H02": h02,
            "MLXHOST_FLEET_ADMIN": f"127.0.0.1:{free_port()}",
        }
        log = (tmp_path / "haproxy.log").open("ab")
        started.append(
            subprocess.Popen(["haproxy", "-db", "-f", str(HAPROXY_CFG)], env=env, stdout=log, stderr=log)
        )
        url = f"http://127.0.0.1:{port}"

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_until(listening, timeout=20, what="haproxy to listen")
        return url

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (code, "server_error", None)
    assert error["message"]


def test_no_host_to_take_a_request_is_a_503_in_the_openai_envelope(proxy):
    """Both hosts refuse connections (down, or killed): HAProxy's 503 is JSON, with Retry-After."""
    url = proxy(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{url}/v1/models", json={} if method == "POST" else None)
        assert_openai_error(response, 503, "no_host_available")
        assert response.headers["retry-after"] == "1"


def test_a_host_that_hangs_up_is_retried_for_a_get_and_a_502_in_the_envelope_for_a_post(proxy):
    """A host that closes the connection without answering (it died after reading the request):
    a GET is sent again and answered 200; a POST, which may have started a turn, reaches the host
    once and its client gets HAProxy's 502 as JSON."""
    host = Host()
    url = proxy(host.address, host.address)
    host.hang_ups = 1
    assert httpx.get(f"{url}/v1/models").status_code == 200
    assert host.seen == ["GET /v1/models", "GET /v1/models"]
    host.seen.clear()
    host.hang_ups = 1
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert_openai_error(response, 502, "host_failed")
    assert host.seen == ["POST /v1/chat/completions"]


@pytest.mark.parametrize("path", sorted(ERRORS.glob("*.http")), ids=lambda path: path.stem)
def test_every_error_file_is_a_complete_openai_error(path: Path):
    """Each file HAProxy sends as is: its status line names its code, its Content-Length is exact
    and its body is the OpenAI error envelope."""
    head, body = path.read_bytes().split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {path.stem} ")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    assert headers["Content-Type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert f"errorfile {path.stem} errors/{path.name}" in HAPROXY_CFG.read_text()
