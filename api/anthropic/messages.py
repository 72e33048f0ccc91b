"""Anthropic message shapes: engine events -> `message` objects and the Messages SSE event sequence."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from api.collect import NO_RESULT, collect_answer
from api.errors import ApiError, cut_short_error, error_body, failed_error
from api.sse import sse_event
from mlxhost.engine import (
    Delta,
    Done,
    Failed,
    Generation,
    ReasoningDelta,
    Started,
    ToolCall,
    ToolCallDelta,
    Usage,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

# The engine says "stop" for EOS and for a stop sequence alike; see `MessageTurn.stop_fields`.
# A cancelled or aborted answer ends with an `error` event instead, never with "end_turn".
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessageTurn:
    """The identity of one assistant message, shared by every event of it."""

    id: str
    model: str
    thinking: bool = False  # the request enabled thinking: reasoning goes out as thinking blocks

    def message(
        self, content: list[dict[str, Any]], usage: dict[str, int], done: Done | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **self.stop_fields(done),
            "usage": usage,
        }

    @staticmethod
    def stop_fields(done: Done | None) -> dict[str, str | None]:
        if done is not None and done.stop_sequence is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": done.stop_sequence}
        reason = None if done is None else STOP_REASONS.get(done.finish_reason, "end_turn")
        return {"stop_reason": reason, "stop_sequence": None}


def usage_body(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` excludes cache reads (their sum is the whole prompt)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _final_usage(usage: Usage) -> dict[str, int]:
    return usage_body(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


async def message_complete(turn: MessageTurn, generation: Generation) -> dict[str, Any]:
    """Collect a generation into one `message` object.

    Raises:
        ApiError: 500 when the model failed mid-generation.
    """
    answer = await collect_answer(generation)
    done = answer.done
    content: list[dict[str, Any]] = []
    if turn.thinking and done.reasoning:
        content.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    if answer.text or not done.tool_calls:
        content.append({"type": "text", "text": answer.text})
    content += [tool_use_block(call) for call in done.tool_calls]
    return turn.message(content, _final_usage(done.usage), done)


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _input_of(call.arguments)}


def _input_of(arguments: str) -> Any:
    # A call cut short by max_tokens has broken JSON: its input is then empty, never a 500.
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def message_sse(turn: MessageTurn, generation: Generation) -> AsyncIterator[bytes]:
    """Stream a generation as Anthropic's events, each with its `event:` line.

    message_start, then per content block (thinking, text, tool_use, as they come)
    content_block_start (the first followed by a ping), its deltas (thinking_delta, text_delta,
    input_json_delta) and content_block_stop, then message_delta and message_stop; a failure
    (even before any block) is one `error` event in
    Anthropic's envelope. An async generator on purpose: Django buffers sync iterators under
    ASGI, and a client disconnect cancels this generator, which stops the generation (LANE-6).
    """
    blocks = _Blocks()
    opened = False
    async for event in generation.stream():
        if isinstance(event, Started | Done) and not opened:
            # Done without Started: cancelled before it ran; the sequence still opens first.
            prompt, cached = (
                (event.prompt_tokens, event.cached_tokens) if isinstance(event, Started) else (0, 0)
            )
            start = {
                "type": "message_start",
                "message": turn.message([], usage_body(prompt, cached, 0), None),
            }
            yield sse_event(start, event="message_start")
            opened = True
        if isinstance(event, Delta) and event.text:
            for frame in blocks.open("text", {"type": "text", "text": ""}):
                yield frame
            yield blocks.delta({"type": "text_delta", "text": event.text})
        elif isinstance(event, ReasoningDelta) and turn.thinking:
            for frame in blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                yield frame
            yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, ToolCallDelta) and event.id is not None:
            start_block: dict[str, Any] = {
                "type": "tool_use",
                "id": event.id,
                "name": event.name,
                "input": {},
            }
            for frame in blocks.open(f"tool{event.index}", start_block):
                yield frame
        elif isinstance(event, ToolCallDelta) and event.arguments:
            yield blocks.delta({"type": "input_json_delta", "partial_json": event.arguments})
        elif isinstance(event, Done) and (cut := cut_short_error(event)) is not None:
            # 503 draining -> overloaded_error (529); a cancel -> api_error.
            yield sse_event(error_body(cut, "anthropic"), event="error")
            return
        elif isinstance(event, Done):
            if blocks.count == 0:  # nothing was said: one empty text block, as Anthropic sends
                for frame in blocks.open("text", {"type": "text", "text": ""}):
                    yield frame
            for frame in blocks.close():
                yield frame
            yield _event("message_delta", delta=turn.stop_fields(event), usage=_final_usage(event.usage))
            yield _event("message_stop")
            return
        elif isinstance(event, Failed):
            yield sse_event(error_body(failed_error(event), "anthropic"), event="error")
            return
    yield sse_event(error_body(ApiError(500, NO_RESULT), "anthropic"), event="error")


class _Blocks:
    """The content blocks of a streamed message: one open at a time, numbered as they open."""

    def __init__(self) -> None:
        self.count = 0
        self.current: str | None = None

    def open(self, key: str, block: dict[str, Any]) -> list[bytes]:
        """The events that close the open block (if another) and start `block`; none if it is open."""
        if self.current == key:
            return []
        frames = self.close()
        self.current = key
        self.count += 1
        frames.append(_event("content_block_start", index=self.count - 1, content_block=block))
        if self.count == 1:
            frames.append(_event("ping"))  # Anthropic's order: the first block, then a ping
        return frames

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.count - 1, delta=delta)

    def close(self) -> list[bytes]:
        if self.current is None:
            return []
        self.current = None
        return [_event("content_block_stop", index=self.count - 1)]


def _event(name: str, **fields: Any) -> bytes:
    return sse_event({"type": name, **fields}, event=name)
