"""Real Redis, real Celery worker processes and a breakable TCP proxy, for the persistence tests.

Redis is the one at REDIS_URL's host (default 127.0.0.1:6379), database 5. Each test publishes to
its own queue, so concurrent runs on one Redis never consume each other's tasks, and teardown
deletes only that queue. With MLXHOST_REQUIRE_SERVICES=1 (CI) an unreachable Redis fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse, urlunparse

import pytest
import redis

from tests.e2e.conftest import database_url, free_port
from tests.support import eventually

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
REDIS_TEST_DB = 5
WORKER_START_TIMEOUT_S = 60.0


def redis_test_url() -> str:
    """REDIS_URL's server (or the local default) with the database the integration tests own."""
    parsed = urlparse(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    return urlunparse(parsed._replace(path=f"/{REDIS_TEST_DB}"))


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = redis_test_url()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        if os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1":
            pytest.fail(f"MLXHOST_REQUIRE_SERVICES=1 but Redis at {url} is unreachable: {exc}")
        pytest.skip(f"Redis at {url} is unreachable: {exc}")
    return url


@pytest.fixture
def queue(redis_url: str) -> Iterator[str]:
    """A queue name of this test's own; its keys are deleted afterwards."""
    name = f"mlxhost-test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    client.delete(name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
    for tag, entry in client.hgetall("unacked").items():  # a killed worker's, restored or not
        if json.loads(entry)[2] == name:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)
    client.close()


@dataclass
class Worker:
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for(self, text: str, timeout: float = 30.0) -> None:
        """Wait for `text` in the worker's output, without blocking the event loop (it publishes)."""

        def printed() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"celery worker exited ({self.process.returncode}):\n{self.output()}")
            return text in self.output()

        try:
            await eventually(printed, timeout=timeout, interval=0.05, what=f"{text!r} from the celery worker")
        except AssertionError as timed_out:
            raise RuntimeError(f"{timed_out}:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL: no warm shutdown, no ack for the task in hand."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Workers:
    """Starts `python -m tests.integration.celery_worker QUEUE` against the test database."""

    redis_url: str
    queue: str
    db_url: str
    logs: Path
    started: list[Worker] = field(default_factory=list)

    async def start(self, **env: str) -> Worker:
        log = self.logs / f"worker-{len(self.started)}.log"
        environ = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
            "DATABASE_URL": self.db_url,
            "REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.celery_worker", self.queue],
                cwd=ROOT,
                env=environ,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        worker = Worker(process, log)
        self.started.append(worker)
        await worker.wait_for(" ready.", timeout=WORKER_START_TIMEOUT_S)
        return worker

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()


@pytest.fixture
def workers(transactional_db, redis_url: str, queue: str, tmp_path: Path) -> Iterator[Workers]:
    """Worker processes for this test; stopped before the test database is flushed."""
    manager = Workers(redis_url=redis_url, queue=queue, db_url=database_url(), logs=tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()


class TcpProxy:
    """A TCP proxy in front of Redis that a test can stop (refused), pause (blackholed) and resume."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._stopping = threading.Event()
        self._accepting: threading.Thread | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: restartable
        listener.settimeout(0.1)
        self._stopping = threading.Event()
        self._accepting = threading.Thread(target=self._accept, args=(listener, self._stopping), daemon=True)
        self._accepting.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection: the broker is down (connection refused)."""
        self._stopping.set()
        self._flowing.set()
        if self._accepting is not None:
            self._accepting.join(timeout=5)
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def pause(self) -> None:
        """Hold every byte in flight: the broker hangs (a blackhole) until `resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def _accept(self, listener: socket.socket, stopping: threading.Event) -> None:
        with listener:
            while not stopping.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()
                    continue
                client.settimeout(None)
                upstream.settimeout(None)
                with self._lock:
                    self._sockets += [client, upstream]
                for src, dst in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def redis_proxy(redis_url: str) -> Iterator[TcpProxy]:
    target = urlparse(redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379).start()
    try:
        yield proxy
    finally:
        proxy.stop()
