"""Server-sent event encoders: pure functions from payloads to wire bytes."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from mlxhost import wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One SSE frame; `data` is JSON-encoded (strictly: NaN raises `wire.NotJSONError`) unless a string."""
    payload = data if isinstance(data, str) else wire.dumps(data)
    head = f"event: {event}\n" if event else ""
    lines = "".join(f"data: {line}\n" for line in payload.split("\n"))
    return f"{head}{lines}\n".encode()


def sse_comment(text: str = "keepalive") -> bytes:
    """A comment frame: proxies see traffic, clients ignore it."""
    return f": {text}\n\n".encode()


def anthropic_ping() -> bytes:
    return sse_event({"type": "ping"}, event="ping")


async def with_keepalive(
    frames: AsyncIterator[bytes], beat: bytes, interval_s: float
) -> AsyncIterator[bytes]:
    """`frames`, with `beat` sent whenever `interval_s` pass without one (a long prefill, a slow
    step), so clients and proxies that time out idle streams keep waiting. Closing this closes
    `frames` (a client disconnect still cancels the generation)."""
    source = aiter(frames)
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield beat
                continue
            finished: asyncio.Future[bytes] = pending
            pending = None
            try:
                frame = finished.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()  # type: ignore[attr-defined]  # every stream here is an async generator


async def merged(streams: Sequence[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The frames of several streams (a request's choices, OpenAI `n`) as each comes. Each stream
    waits while the reader is slow, as one stream would; closing this, or one stream raising,
    closes them all (their generations are cancelled)."""
    if len(streams) == 1:
        async for frame in streams[0]:
            yield frame
        return
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for frame in stream:
                await queue.put(frame)
        except Exception as error:
            await queue.put(error)
        else:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                left -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
