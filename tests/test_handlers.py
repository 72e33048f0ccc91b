"""The ASGI handler (`mlxhost/handlers.py`): API requests start no thread of their own (issue 25 §4)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxhost.handlers import ApiASGIHandler

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


async def call(handler: ApiASGIHandler, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """One GET through the handler as daphne calls it; the response's status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    sent: list[dict] = []
    delivered = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await handler(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@pytest.mark.parametrize(
    ("path", "module", "name", "shared"),
    [
        pytest.param("/v1/models", "api.openai.views", "_model_list", True, id="api"),
        pytest.param("/readyz", "api.health", "_served_models", False, id="probe"),
    ],
)
async def test_api_requests_share_one_sync_thread_and_other_paths_get_their_own(
    path, module, name, shared, api_key, monkeypatch
):
    """Django gives each request a fresh sync thread (two thread starts on the event loop);
    under /v1/ every request's sync calls run on one long-lived thread instead."""
    import importlib

    target = importlib.import_module(module)
    original = getattr(target, name)
    threads: list[str] = []

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(target, name, recorded)
    handler = ApiASGIHandler()
    headers = [(b"authorization", f"Bearer {api_key}".encode())]
    for _ in range(3):
        assert await call(handler, path, headers) in (200, 503)
    assert len(threads) == 3
    assert (len(set(threads)) == 1) is shared, threads
