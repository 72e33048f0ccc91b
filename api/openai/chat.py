"""OpenAI chat completion shapes: engine events -> `chat.completion` objects and SSE chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.collect import collect_answer
from api.errors import cut_short_error, error_body, failed_error
from api.sse import SSE_DONE, sse_event
from api.tools import logprob_body
from mlxhost.engine import (
    Delta,
    Done,
    Failed,
    Generation,
    Queued,
    ReasoningDelta,
    Started,
    ToolCall,
    ToolCallDelta,
    Usage,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

# Complete or length-limited answers only: "cancelled" and "aborted" end the stream with an error
# event instead (the openai SDK raises APIError on it), never with a finish_reason that reads
# like a complete answer.
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# The finish_reason of a stream the engine cut short (a drain ran out, a cancel): vLLM's word. The
# final chunk always carries one (OPS-5); the error chunk after it says why (`draining`: retry).
CUT_SHORT_FINISH = "abort"


@dataclass
class ChatTurn:
    """The identity of one completion, shared by every chunk of it."""

    id: str
    model: str
    instance_id: int
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"fp_mlxhost_{self.instance_id}",
        }

    def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        body = self.envelope("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if self.include_usage:
            body["usage"] = None
        return body


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        # OpenAI's shape: the prediction counts are there with or without a prediction.
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


async def chat_sse(turn: ChatTurn, generation: Generation) -> AsyncIterator[bytes]:
    """Stream a generation as OpenAI chunks, ending with `data: [DONE]`.

    An async generator on purpose: Django buffers sync iterators under ASGI. When the client
    disconnects, Django cancels this generator and `Generation.stream()` sets the stop flag.
    """
    request = generation.request
    mode = request.tool_choice.mode if request.tools else "none"
    # The opening delta: `content` is null when a tool call follows, as OpenAI's is (a "" there
    # is an empty text part to Vercel's useChat). With `auto` that is known at the first event.
    opened = mode != "auto"
    if opened:
        yield sse_event(turn.chunk({"role": "assistant", "content": None if mode == "required" else ""}))
    async for event in generation.stream():
        if not opened and _shows(event):
            opened = True
            content = "" if isinstance(event, Delta) else None
            yield sse_event(turn.chunk({"role": "assistant", "content": content}))
        if isinstance(event, Delta) and (event.text or event.logprobs):
            logprobs = {"content": [logprob_body(lp) for lp in event.logprobs]} if event.logprobs else None
            yield sse_event(turn.chunk({"content": event.text}, logprobs=logprobs))
        elif isinstance(event, ReasoningDelta):
            yield sse_event(turn.chunk({"reasoning_content": event.text}))
        elif isinstance(event, ToolCallDelta):
            yield sse_event(turn.chunk({"tool_calls": [tool_call_part(event)]}))
        elif isinstance(event, Done):
            cut = cut_short_error(event)
            finish = CUT_SHORT_FINISH if cut else FINISH_REASONS.get(event.finish_reason, "stop")
            yield sse_event(turn.chunk({}, finish))
            if turn.include_usage:
                final = turn.envelope("chat.completion.chunk")
                final.update(choices=[], usage=usage_body(event.usage))
                yield sse_event(final)
            if cut is not None:
                yield sse_event(error_body(cut, "openai"))
        elif isinstance(event, Failed):
            yield sse_event(error_body(failed_error(event), "openai"))
    yield SSE_DONE


def _shows(event: object) -> bool:
    """Whether `event` is the answer's first output: text, reasoning, a call, or its end."""
    if isinstance(event, Delta):
        return bool(event.text or event.logprobs)
    return not isinstance(event, Queued | Started)


async def chat_complete(turn: ChatTurn, generation: Generation) -> dict[str, Any]:
    """Collect a generation into one `chat.completion` object.

    Raises:
        ApiError: 500 when the model failed mid-generation.
    """
    answer = await collect_answer(generation)
    done = answer.done
    body = turn.envelope("chat.completion")
    message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
    if done.tool_calls:
        message["content"] = answer.text or None
        message["tool_calls"] = [tool_call_body(call) for call in done.tool_calls]
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    logprobs = None
    if generation.request.sampling.logprobs is not None:
        logprobs = {"content": [logprob_body(lp) for lp in answer.logprobs], "refusal": None}
    body["choices"] = [
        {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": FINISH_REASONS.get(done.finish_reason, "stop"),
        }
    ]
    body["usage"] = usage_body(done.usage)
    return body


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_part(part: ToolCallDelta) -> dict[str, Any]:
    """A streamed piece of a call: the first names it, the rest carry its arguments, as OpenAI streams."""
    if part.id is not None:
        return {
            "index": part.index,
            "id": part.id,
            "type": "function",
            "function": {"name": part.name, "arguments": part.arguments},
        }
    return {"index": part.index, "function": {"arguments": part.arguments}}
