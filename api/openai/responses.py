"""OpenAI Responses shapes: engine events -> `response` objects and the Responses SSE event sequence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from api.errors import failed_error
from api.sse import sse_event
from mlxhost.engine import Delta, Done, Failed, Generation, Usage

# What storing a turn returns: awaited before the terminal event, so the record is durable first.
Handoff = asyncio.Future[None]
OnEnd = Callable[["ResponseTurn"], Handoff | None]

# Engine finish reasons -> (response status, incomplete reason).
STATUS = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "cancelled": ("cancelled", None),
    # Cut short by a drain timeout (unload, reload, shutdown): incomplete, and why.
    "aborted": ("incomplete", "draining"),
}


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass
class ResponseTurn:
    """One response being produced: its identity, settings, and what it has said so far."""

    id: str
    model: str
    instructions: str | None
    previous_response_id: str | None
    store: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    text: str = ""
    usage: Usage | None = None
    error: dict[str, str] | None = None
    incomplete_reason: str | None = None
    sequence: int = 0

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def message_item(self, *, done: bool) -> dict[str, Any]:
        status = "in_progress" if not done else ("completed" if self.status == "completed" else "incomplete")
        content = [self.text_part()] if done else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def body(self) -> dict[str, Any]:
        """The `response` object as it stands."""
        finished = self.status not in ("in_progress", "queued")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": [self.message_item(done=True)] if finished and self.status != "failed" else [],
            "parallel_tool_calls": False,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": usage_body(self.usage),
            "metadata": self.metadata,
        }

    def finish(self, event: Done | Failed) -> None:
        if isinstance(event, Failed):
            error = failed_error(event)  # a fixed text for load failures: no paths to clients
            self.status = "failed"
            self.error = {"code": event.code, "message": error.message}
            return
        self.status, self.incomplete_reason = STATUS.get(event.finish_reason, ("completed", None))
        self.usage = event.usage

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload


async def response_sse(turn: ResponseTurn, generation: Generation, on_end: OnEnd) -> AsyncIterator[bytes]:
    """The Responses events as server-sent events, each named by its type."""
    async for event in response_events(turn, generation, on_end):
        yield sse_event(event, event=event["type"])


async def response_events(
    turn: ResponseTurn, generation: Generation, on_end: OnEnd
) -> AsyncIterator[dict[str, Any]]:
    """Stream a generation as Responses event objects, ending with completed / incomplete / failed.

    The SSE stream and the WebSocket send these same objects. `on_end` runs once the turn is
    over, and its handoff is awaited BEFORE the terminal event goes out: a client that saw the
    final event has a turn that survives the process dying right after (PER-1). When the client
    hung up, `on_end` still runs (from `finally`) so the turn is stored with its true status,
    but nothing waits for it.
    """
    item = {"item_id": turn.message_id, "output_index": 0}
    ended = False
    try:
        yield turn.event("response.created", response=turn.body())
        yield turn.event("response.in_progress", response=turn.body())
        yield turn.event("response.output_item.added", output_index=0, item=turn.message_item(done=False))
        yield turn.event("response.content_part.added", **item, content_index=0, part=_empty_part())
        async for event in generation.stream():
            if isinstance(event, Delta) and event.text:
                turn.text += event.text
                yield turn.event(
                    "response.output_text.delta", **item, content_index=0, delta=event.text, logprobs=[]
                )
            elif isinstance(event, Done | Failed):
                turn.finish(event)
        if turn.status != "failed":
            yield turn.event(
                "response.output_text.done", **item, content_index=0, text=turn.text, logprobs=[]
            )
            yield turn.event("response.content_part.done", **item, content_index=0, part=turn.text_part())
            yield turn.event("response.output_item.done", output_index=0, item=turn.message_item(done=True))
        terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
            turn.status, "response.incomplete"
        )
        ended = True
        await _handed_off(on_end(turn))
        yield turn.event(terminal, response=turn.body())
    finally:
        if not ended:
            if turn.status == "in_progress":  # the client hung up: the turn was cancelled
                turn.status = "cancelled"
            on_end(turn)  # stored in the background; nobody is left to tell


async def response_collect(turn: ResponseTurn, generation: Generation, on_end: OnEnd) -> dict[str, Any]:
    """Run a generation to its end and return the `response` object, stored durably first (PER-1)."""
    ended = False
    try:
        async for event in generation.stream():
            if isinstance(event, Delta):
                turn.text += event.text
            elif isinstance(event, Done | Failed):
                turn.finish(event)
        if turn.status == "in_progress":  # the stream ended without a Done: report it as cut short
            turn.status = "cancelled"
        ended = True
        await _handed_off(on_end(turn))
    finally:
        if not ended:
            if turn.status == "in_progress":
                turn.status = "cancelled"
            on_end(turn)
    return turn.body()


async def _handed_off(handoff: Handoff | None) -> None:
    # The handoff never raises (failures are logged and left to the breaker); a cancelled waiter
    # leaves the shielded write running.
    if handoff is not None:
        await handoff


def _empty_part() -> dict[str, Any]:
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
