"""`make fleet` itself (`deploy/fleet.py`, the process a user starts): a host SIGKILLed from outside
comes back under the running process while the other serves, and SIGTERM stops everything in order.

`test_fleet.py` drives the `Fleet` class in the test process; this one runs the script as a user
does, on a database of its own (it migrates and prepares the demo there itself), and finds the host
to kill the way an operator would, by the port it listens on. No fixture fleet runs beside it: the
ports here are free ones, so both may run in one session, one after the other.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psycopg
import pytest

from tests.e2e.conftest import database_url
from tests.support import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.fleet]

ROOT = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> int:
    """A base port b with b, b + 1, ..., b + count - 1 all free now (the hosts use admin + n)."""
    import socket

    for base in range(20_000, 60_000, 97):
        try:
            socks = []
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base
    raise RuntimeError("no run of free ports")


def pid_listening_as_daphne(port: int) -> int | None:
    """The pid of the daphne started with `-p <port>`, read from /proc as `ps` would."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daphne" in argv and b"-p" in argv and argv[argv.index(b"-p") + 1] == str(port).encode():
            return int(entry.name)
    return None


class Running:
    """`deploy/fleet.py` as a child process, with its output lines collected as they come."""

    def __init__(self, env: dict[str, str], port: int, admin_port: int, folder: Path) -> None:
        argv = [sys.executable, "deploy/fleet.py", "--port", str(port), "--admin-port", str(admin_port)]
        argv += ["--folder", str(folder)]
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def output(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def fleet_database(django_db_setup, django_db_blocker) -> Iterator[str]:
    """A PostgreSQL database of this test's own, dropped afterwards (the script creates it)."""
    with django_db_blocker.unblock():
        url = database_url()
    if not url.startswith("postgres"):
        pytest.fail("the fleet tests need DATABASE_URL on PostgreSQL (docs/fleet.md)")
    name = f"mlxhost_make_fleet_{uuid.uuid4().hex[:8]}"
    yield url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_make_fleet_brings_a_killed_host_back_and_stops_in_order(fleet_database, tmp_path):
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        pytest.fail("the fleet tests need REDIS_URL (docs/fleet.md)")
    base = free_ports(4)
    port, admin_port = base + 3, base
    env = {
        **os.environ,
        "DATABASE_URL": fleet_database,
        "REDIS_URL": redis_url,
        "MLXHOST_CELERY_QUEUE": f"mlxhost-make-fleet-{uuid.uuid4().hex[:12]}",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("MLXHOST_HOST_ID", None)
    fleet = Running(env, port, admin_port, tmp_path / "fleet")
    try:
        wait_until(
            lambda: fleet.said("Fleet serving on") or fleet.process.poll() is not None,
            timeout=240,
            interval=0.5,
            what="the fleet to serve",
        )
        assert fleet.process.poll() is None, fleet.output()
        key = re.search(r"(mlxh_\S+)", fleet.output())
        assert key is not None, fleet.output()
        headers = {"Authorization": f"Bearer {key[1]}"}
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def answered() -> int:
            return httpx.post(url, json=body, headers=headers, timeout=120).status_code

        assert answered() == 200, fleet.output()
        host_one = pid_listening_as_daphne(admin_port + 1)
        assert host_one is not None
        os.kill(host_one, signal.SIGKILL)  # from outside, as the OOM killer would
        # The signal is delivered, then the kernel tears the process down: until its sockets are
        # closed, a connection may still be accepted and then reset, and a POST that reached a
        # host is never replayed (deploy/haproxy.cfg), so its client gets the 502. Once the
        # process is gone (or a zombie, whose cmdline reads empty) the port refuses, and
        # HAProxy sends each request to the host left.
        wait_until(
            lambda: pid_listening_as_daphne(admin_port + 1) != host_one,
            timeout=30,
            interval=0.02,
            what="the killed host's process to be gone",
        )
        assert [answered() for _ in range(3)] == [200] * 3, fleet.output()
        wait_until(lambda: fleet.said("fleet: h01 is back"), timeout=180, interval=0.5, what="h01 back")
        assert fleet.said("fleet: h01 exited (code -9); starting it again"), fleet.output()
        again = pid_listening_as_daphne(admin_port + 1)
        assert again is not None and again != host_one
        assert answered() == 200
        fleet.process.send_signal(signal.SIGTERM)
        assert fleet.process.wait(timeout=90) == 0, fleet.output()
    finally:
        if fleet.process.poll() is None:
            fleet.process.kill()
            fleet.process.wait()
    fleet._reader.join(10)
    out = fleet.output()
    stopping = [line for line in out.splitlines() if line.startswith("fleet: stopping ")]
    assert stopping[:3] == [
        "fleet: stopping (the proxy first, then the hosts drain)",
        "fleet: stopping proxy",
        "fleet: stopping admin, h01, h02",
    ], out
    assert out.splitlines()[-1] == "fleet: stopped", out
    assert all(pid_listening_as_daphne(admin_port + n) is None for n in (0, 1, 2)), out
