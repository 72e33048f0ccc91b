"""Anthropic message shapes: engine events -> `message` objects and the Messages SSE event sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from api.collect import NO_RESULT, collect_text
from api.errors import ApiError, cut_short_error, error_body, failed_error
from api.sse import sse_event
from mlxhost.engine import Delta, Done, Failed, Generation, Started, Usage

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

# The engine says "stop" for EOS and for a stop sequence alike; see `MessageTurn.stop_fields`.
# A cancelled or aborted answer ends with an `error` event instead, never with "end_turn".
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@dataclass
class MessageTurn:
    """The identity of one assistant message, shared by every event of it."""

    id: str
    model: str

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
    text, done = await collect_text(generation)
    return turn.message([{"type": "text", "text": text}], _final_usage(done.usage), done)


async def message_sse(turn: MessageTurn, generation: Generation) -> AsyncIterator[bytes]:
    """Stream a generation as Anthropic's events, each with its `event:` line.

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta, message_stop; a failure is one `error` event in Anthropic's envelope.
    An async generator on purpose: Django buffers sync iterators under ASGI, and a client
    disconnect cancels this generator, which stops the generation (LANE-6).
    """
    opened = False
    async for event in generation.stream():
        if isinstance(event, Started | Done) and not opened:
            # Done without Started: cancelled before it ran; the sequence still opens first.
            prompt, cached = (
                (event.prompt_tokens, event.cached_tokens) if isinstance(event, Started) else (0, 0)
            )
            for name, data in _opening(turn, usage_body(prompt, cached, 0)):
                yield sse_event(data, event=name)
            opened = True
        if isinstance(event, Delta) and event.text:
            delta = {"type": "text_delta", "text": event.text}
            yield _event("content_block_delta", index=0, delta=delta)
        elif isinstance(event, Done) and (cut := cut_short_error(event)) is not None:
            # 503 draining -> overloaded_error (529); a cancel -> api_error.
            yield sse_event(error_body(cut, "anthropic"), event="error")
            return
        elif isinstance(event, Done):
            yield _event("content_block_stop", index=0)
            yield _event("message_delta", delta=turn.stop_fields(event), usage=_final_usage(event.usage))
            yield _event("message_stop")
            return
        elif isinstance(event, Failed):
            yield sse_event(error_body(failed_error(event), "anthropic"), event="error")
            return
    yield sse_event(error_body(ApiError(500, NO_RESULT), "anthropic"), event="error")


def _opening(turn: MessageTurn, usage: dict[str, int]) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("message_start", {"type": "message_start", "message": turn.message([], usage, None)}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        ("ping", {"type": "ping"}),
    ]


def _event(name: str, **fields: Any) -> bytes:
    return sse_event({"type": name, **fields}, event=name)
