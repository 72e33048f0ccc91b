"""Helpers shared by the API tests: requests, SSE parsing, stream readers, sockets, alias edits."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from mlxhost.asgi import application

HELLO = [{"role": "user", "content": "hello there"}]
WS_PATH = "/ws/v1/responses"
WS_HOST = (b"host", b"testserver")
WS_TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def bearer(key: str | None) -> dict[str, str]:
    """The OpenAI-style auth header for `key` (none for a missing key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def every_auth(key: str) -> dict[str, str]:
    """Auth headers every surface accepts: OpenAI's bearer and Anthropic's x-api-key with its version."""
    return {"Authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01"}


async def post_any(api_key: str, path: str, body: dict[str, Any]):
    """POST `body` to any surface's `path` with `every_auth` headers."""
    return await post_json(path, body, every_auth(api_key))


async def post_json(path: str, body: dict[str, Any], headers: dict[str, str]):
    """POST `body` as JSON through the ASGI test client."""
    return await AsyncClient().post(
        path, data=json.dumps(body), content_type="application/json", headers=headers
    )


async def post_chat(api_key: str, **fields: Any):
    """A chat completion for the `tiny` alias, `fields` added to the body."""
    return await post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, **fields}, bearer(api_key)
    )


def body_problem(status: int, content_type: str | None, content: bytes) -> str | None:
    """Why an API answer's body is not what API-4 promises (JSON, or for a 200 stream SSE of
    JSON events), or None."""
    if content_type == "text/event-stream" and status == 200:
        for line in content.decode().split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    json.loads(line.removeprefix("data: "))
                except ValueError:
                    return f"an event that is not JSON: {line[:100]!r}"
        return None
    if content_type != "application/json":
        return f"Content-Type {content_type!r}"
    try:
        json.loads(content)
    except ValueError:
        return f"not JSON: {content[:100]!r}"
    return None


async def sse_payloads(response) -> list:
    """The `data:` payloads of an OpenAI-style SSE response, JSON-decoded; `[DONE]` kept as text."""
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    frames = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    return [frame if frame == "[DONE]" else json.loads(frame) for frame in frames]


async def sse_events(response) -> list[tuple[str, dict]]:
    """The `(event, data)` pairs of an Anthropic-style SSE response."""
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = []
    for frame in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def save_alias(alias, **fields: Any):
    """Edit `alias` as the admin does, and its model for model fields (lane, memory, weights);
    returns the alias. Engines reconcile on the commit's `models.changed` message."""
    from models_app.catalogue import services

    def save():
        model_fields = {k: fields.pop(k) for k in list(fields) if k in services.MODEL_ONLY_FIELDS}
        if model_fields:
            for name, value in model_fields.items():
                setattr(alias.model, name, value)
            services.model_save(model=alias.model)
        for name, value in fields.items():
            setattr(alias, name, value)
        return services.alias_save(alias=alias)

    return await sync_to_async(save)()


async def set_lane(alias, **fields: Any):
    """Set lane settings (`concurrency`, `queue_depth`, `queue_timeout_s`) on the model `alias`
    serves, then reconcile this process's engine, as its control listener does on the commit's
    `models.changed` message (only control binds, REG-5)."""
    from mlxhost.runtime import engine_if_started
    from models_app.catalogue import reconcile as control

    saved = await save_alias(alias, **fields)
    if (engine := engine_if_started()) is not None:
        await control.reconcile(engine, load_pinned=False)
    return saved


async def act(alias, action: str) -> None:
    """The admin's load / unload / reload button on the alias's model."""
    from models_app.catalogue import services

    await sync_to_async(services.model_request_action)(model=alias.model, action=action)


def capacity_of(engine, instance_id: int) -> int:
    """The lane capacity of one instance, as the engine's snapshot reports it."""
    [capacity] = [
        snap["lane"]["capacity"] for snap in engine.snapshot() if snap["instance_id"] == instance_id
    ]
    return capacity


class StreamReader:
    """Reads an SSE response in a task, as the ASGI server would; `hang_up()` cancels that task.

    Cancelling the reading task is what Django does when the client disconnects.
    """

    def __init__(self, response) -> None:
        self.frames = 0
        self._progress = asyncio.Event()
        self._task = asyncio.create_task(self._read(response))

    async def _read(self, response) -> None:
        async for chunk in response.streaming_content:
            self.frames += chunk.count(b"data: ")
            self._progress.set()

    async def wait_for(self, frames: int) -> None:
        while self.frames < frames:
            self._progress.clear()
            await asyncio.wait_for(self._progress.wait(), timeout=30)

    async def hang_up(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class ScriptedGeneration:
    """Stands in for `Generation` in the pure encoder tests: replays a list of engine events."""

    session_outcome = "fresh"  # as a Generation that reused no cache says (X-Session-Cache)

    def __init__(self, *events: object) -> None:
        self.events = events

        self.cancels = 0

    async def stream(self):
        for event in self.events:
            yield event

    def cancel(self) -> None:
        self.cancels += 1  # the encoders cancel every choice as they end (a no-op once it ended)


def settled(actions, model: str, action: str) -> bool:
    """The control listener's last `action` on the model `model` has finished, done or failed."""
    result = actions.results.get(model, {})
    return result.get("action") == action and result.get("state") in ("done", "failed")


def key_headers(api_key: str, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [WS_HOST, (b"authorization", f"Bearer {api_key}".encode()), *extra]


async def connect(headers: list[tuple[bytes, bytes]], path: str = WS_PATH) -> WebsocketCommunicator:
    """An accepted WebSocket on the ASGI application."""
    socket = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await socket.connect(timeout=10)
    assert connected, code
    return socket


async def frames_until(socket: WebsocketCommunicator, *types: str, timeout: float = 60) -> list[dict]:
    """Every frame up to and including the first whose type is one of `types`."""
    seen = []
    while True:
        frame = json.loads(await socket.receive_from(timeout=timeout))
        seen.append(frame)
        if frame["type"] in types:
            return seen


async def ws_create(socket: WebsocketCommunicator, **body: Any) -> None:
    await socket.send_to(text_data=json.dumps({"type": "response.create", "model": "tiny", **body}))
