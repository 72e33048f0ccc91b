"""OpenAI Responses shapes: engine events -> `response` objects and the Responses SSE event sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.errors import failed_error
from api.sse import sse_event
from api.tools import logprob_body
from mlxhost.engine import Delta, Done, Failed, ReasoningDelta, ToolCall, ToolCallDelta, Usage
from models_app.turns.response_turns import (
    STATUS,
    StartedResponse,
    function_call_item,
    output_items,
    output_message,
    reasoning_item,
    usage_body,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator

    from models_app.turns.turns import StartedTurn


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
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request sent them
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    parallel_tool_calls: bool = True
    output: list[dict[str, Any]] | None = None  # the finished output items (a stored row's)
    done: Done | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # offered name -> (namespace, name)

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def message_item(self, *, done: bool) -> dict[str, Any]:
        if done:
            return output_message(self.id, self.text, self.status, self.logprobs)
        return {
            "type": "message",
            "id": self.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def items(self) -> list[dict[str, Any]]:
        """The output items as they stand: none until the response has finished."""
        if self.output is not None:
            return self.output
        if self.status in ("in_progress", "queued"):
            return []
        return output_items(self.id, self.text, self.status, self.done, self.logprobs, self.namespaced)

    def body(self) -> dict[str, Any]:
        """The `response` object as it stands."""
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
            "output": self.items(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {"format": self.text_format},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
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
        self.done = event

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload


def response_shape(data: dict[str, Any], started: StartedResponse) -> ResponseTurn:
    """The `response` object an admitted turn of a validated `ResponsesInput` body builds up; it
    echoes the tools, tool choice and text format as the body sent them (`data["echo"]`)."""
    raw = data.get("echo") or {}
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
        tools=list(raw.get("tools") or []),
        tool_choice=raw.get("tool_choice") or "auto",
        text_format=((raw.get("text") or {}).get("format")) or {"type": "text"},
        parallel_tool_calls=raw.get("parallel_tool_calls") is not False,
        namespaced=data["tools"].namespaced if data.get("tools") else {},
    )


async def response_sse(response: ResponseTurn, turn: StartedTurn) -> AsyncIterator[bytes]:
    """The Responses events as server-sent events, each named by its type."""
    async for event in response_events(response, turn):
        yield sse_event(event, event=event["type"])


async def response_events(response: ResponseTurn, turn: StartedTurn) -> AsyncGenerator[dict[str, Any], None]:
    """Stream a turn as Responses event objects, ending with completed / incomplete / failed.

    The SSE stream and the WebSocket send these same objects. Output items open as their first
    part arrives (reasoning, the message, each function call) and close at the end. The turn
    service records the turn before it passes on the generation's last event, so a client that
    saw the terminal event has a turn that survives the process dying right after (PER-1);
    closing this iterator early closes the turn's, which records it as cancelled.
    """
    events = turn.events()
    writer = _OutputWriter(response)
    try:
        yield response.event("response.created", response=response.body())
        yield response.event("response.in_progress", response=response.body())
        async for event in events:
            if isinstance(event, Done | Failed):
                response.finish(event)
            else:
                for out in writer.feed(event):
                    yield out
        for out in writer.close():
            yield out
        terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
            response.status, "response.incomplete"
        )
        yield response.event(terminal, response=response.body())
    finally:
        if response.status == "in_progress":  # the client hung up: the turn was cancelled
            response.status = "cancelled"
        await events.aclose()  # the service records a turn cut short (PER-1)


class _OutputWriter:
    """The item events of one response: `output_item.added`, their deltas, their `.done` events."""

    def __init__(self, response: ResponseTurn) -> None:
        self.r = response
        self.indexes: dict[str, int] = {}  # "reasoning", "message", "call<i>" -> output_index
        self.reasoning: list[str] = []
        self.calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments...]

    def _open(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        if key in self.indexes:
            return []
        self.indexes[key] = index = len(self.indexes)
        out = [self.r.event("response.output_item.added", output_index=index, item=item)]
        if key == "message":
            item_ref = {"item_id": self.r.message_id, "output_index": index}
            out.append(
                self.r.event("response.content_part.added", **item_ref, content_index=0, part=_empty_part())
            )
        return out

    def feed(self, event: object) -> list[dict[str, Any]]:
        r = self.r
        if isinstance(event, Delta) and (event.text or event.logprobs):
            out = self._open("message", r.message_item(done=False))
            entries = [logprob_body(lp) for lp in event.logprobs]
            r.text += event.text
            r.logprobs += entries
            where = {"item_id": r.message_id, "output_index": self.indexes["message"]}
            out.append(
                r.event(
                    "response.output_text.delta", **where, content_index=0, delta=event.text, logprobs=entries
                )
            )
            return out
        if isinstance(event, ReasoningDelta):
            item = reasoning_item(r.id, "", "in_progress")
            out = self._open("reasoning", item)
            self.reasoning.append(event.text)
            where = {"item_id": item["id"], "output_index": self.indexes["reasoning"]}
            out.append(r.event("response.reasoning_text.delta", **where, content_index=0, delta=event.text))
            return out
        if isinstance(event, ToolCallDelta):
            key = f"call{event.index}"
            if event.id is not None:
                self.calls[event.index] = [event.id, event.name or "", ""]
                call = ToolCall(event.id, event.name or "", "")
                return self._open(
                    key, function_call_item(r.id, event.index, call, "in_progress", r.namespaced)
                )
            self.calls[event.index][2] += event.arguments
            item_id = f"fc_{r.id.removeprefix('resp_')}_{event.index}"
            where = {"item_id": item_id, "output_index": self.indexes[key]}
            return [r.event("response.function_call_arguments.delta", **where, delta=event.arguments)]
        return []

    def close(self) -> list[dict[str, Any]]:
        """The closing events of every open item (an empty message when nothing was said)."""
        r = self.r
        if r.status == "failed":
            return []
        out: list[dict[str, Any]] = []
        if not self.calls:
            out += self._open("message", r.message_item(done=False))
        for key, index in self.indexes.items():
            if key == "reasoning":
                item = reasoning_item(r.id, "".join(self.reasoning))
                where = {"item_id": item["id"], "output_index": index}
                out.append(
                    r.event(
                        "response.reasoning_text.done", **where, content_index=0, text="".join(self.reasoning)
                    )
                )
            elif key == "message":
                where = {"item_id": r.message_id, "output_index": index}
                out.append(
                    r.event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=r.text,
                        logprobs=r.logprobs,
                    )
                )
                out.append(
                    r.event("response.content_part.done", **where, content_index=0, part=r.text_part())
                )
                item = r.message_item(done=True)
            else:
                call_index = int(key.removeprefix("call"))
                call_id, name, arguments = self.calls[call_index]
                item = function_call_item(
                    r.id, call_index, ToolCall(call_id, name, arguments), namespaced=r.namespaced
                )
                where = {"item_id": item["id"], "output_index": index}
                out.append(
                    r.event("response.function_call_arguments.done", **where, name=name, arguments=arguments)
                )
            out.append(r.event("response.output_item.done", output_index=index, item=item))
        return out


async def response_collect(response: ResponseTurn, turn: StartedTurn) -> dict[str, Any]:
    """Run a turn to its end and return the `response` object, stored durably first (PER-1)."""
    events = turn.events()
    writer = _OutputWriter(response)
    try:
        async for event in events:
            if isinstance(event, Done | Failed):
                response.finish(event)
            else:
                writer.feed(event)  # the same bookkeeping as the stream, its events unsent
    finally:
        if response.status == "in_progress":  # the stream ended without a Done: it was cut short
            response.status = "cancelled"
        await events.aclose()
    return response.body()


def _empty_part() -> dict[str, Any]:
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
