"""Server-sent event encoders: pure functions from payloads to wire bytes."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One SSE frame; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    lines = "".join(f"data: {line}\n" for line in payload.split("\n"))
    return f"{head}{lines}\n".encode()


def sse_comment(text: str = "keepalive") -> bytes:
    """A comment frame: proxies see traffic, clients ignore it."""
    return f": {text}\n\n".encode()
