"""OpenAI Responses shapes: engine events -> `response` objects and the Responses SSE event sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.errors import failed_error
from api.sse import sse_event
from mlxhost.engine import Delta, Done, Failed, Usage
from models_app.response_turns import STATUS, StartedResponse, output_message, usage_body

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator

    from models_app.turns import StartedTurn


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
        if done:
            return output_message(self.id, self.text, self.status)
        return {
            "type": "message",
            "id": self.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
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


def response_shape(data: dict[str, Any], started: StartedResponse) -> ResponseTurn:
    """The `response` object an admitted turn of a validated `ResponsesInput` body builds up."""
    return ResponseTurn(
        id=started.turn.request_id,
        model=started.turn.model,
        instructions=started.instructions,
        previous_response_id=data.get("previous_response_id"),
        store=data["store"],
        max_output_tokens=data.get("max_tokens"),
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        metadata=data.get("metadata") or {},
        created_at=started.turn.created_at,
    )


async def response_sse(response: ResponseTurn, turn: StartedTurn) -> AsyncIterator[bytes]:
    """The Responses events as server-sent events, each named by its type."""
    async for event in response_events(response, turn):
        yield sse_event(event, event=event["type"])


async def response_events(response: ResponseTurn, turn: StartedTurn) -> AsyncGenerator[dict[str, Any], None]:
    """Stream a turn as Responses event objects, ending with completed / incomplete / failed.

    The SSE stream and the WebSocket send these same objects. The turn service records the
    turn before it passes on the generation's last event, so a client that saw the terminal
    event has a turn that survives the process dying right after (PER-1); closing this
    iterator early closes the turn's, which records it as cancelled.
    """
    item = {"item_id": response.message_id, "output_index": 0}
    events = turn.events()
    try:
        yield response.event("response.created", response=response.body())
        yield response.event("response.in_progress", response=response.body())
        yield response.event(
            "response.output_item.added", output_index=0, item=response.message_item(done=False)
        )
        yield response.event("response.content_part.added", **item, content_index=0, part=_empty_part())
        async for event in events:
            if isinstance(event, Delta) and event.text:
                response.text += event.text
                yield response.event(
                    "response.output_text.delta", **item, content_index=0, delta=event.text, logprobs=[]
                )
            elif isinstance(event, Done | Failed):
                response.finish(event)
        if response.status != "failed":
            yield response.event(
                "response.output_text.done", **item, content_index=0, text=response.text, logprobs=[]
            )
            part = response.text_part()
            yield response.event("response.content_part.done", **item, content_index=0, part=part)
            done_item = response.message_item(done=True)
            yield response.event("response.output_item.done", output_index=0, item=done_item)
        terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
            response.status, "response.incomplete"
        )
        yield response.event(terminal, response=response.body())
    finally:
        if response.status == "in_progress":  # the client hung up: the turn was cancelled
            response.status = "cancelled"
        await events.aclose()  # the service records a turn cut short (PER-1)


async def response_collect(response: ResponseTurn, turn: StartedTurn) -> dict[str, Any]:
    """Run a turn to its end and return the `response` object, stored durably first (PER-1)."""
    events = turn.events()
    try:
        async for event in events:
            if isinstance(event, Delta):
                response.text += event.text
            elif isinstance(event, Done | Failed):
                response.finish(event)
    finally:
        if response.status == "in_progress":  # the stream ended without a Done: it was cut short
            response.status = "cancelled"
        await events.aclose()
    return response.body()


def _empty_part() -> dict[str, Any]:
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
