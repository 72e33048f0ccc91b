"""OpenAI chat completion shapes: engine events -> `chat.completion` objects and SSE chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.collect import Collected, collect_answers
from api.errors import cut_short_error, error_body, failed_error
from api.sse import SSE_DONE, merged, sse_event
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
    from collections.abc import AsyncIterator, Callable, Sequence

    from api.errors import ApiError

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
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None, index: int = 0
    ) -> dict[str, Any]:
        body = self.envelope("chat.completion.chunk")
        body["choices"] = [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
        if self.include_usage:
            body["usage"] = None
        return body


def choices_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of a request's choices (OpenAI `n`), as OpenAI counts it: the prompt once (the
    first choice's, with its cached tokens), the completion tokens of every choice summed."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in usages),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in usages),
    )


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


async def chat_sse(turn: ChatTurn, generations: Sequence[Generation]) -> AsyncIterator[bytes]:
    """Stream a request's choices as OpenAI chunks (each with its choice's `index`), then the
    usage of them all when asked for, then the first error if one was cut short or failed, then
    `data: [DONE]`.

    An async generator on purpose: Django buffers sync iterators under ASGI. When the client
    disconnects, Django cancels this generator and every choice's generation is cancelled.
    """
    async for frame in choices_sse(turn, generations, _choice_sse, "chat.completion.chunk"):
        yield frame


async def choices_sse(
    turn: ChatTurn,
    generations: Sequence[Generation],
    choice_sse: Callable[[ChatTurn, Generation, int, list[Done | Failed | None]], AsyncIterator[bytes]],
    chunk_object: str,
) -> AsyncIterator[bytes]:
    """Every choice's chunks (`choice_sse` each), merged as they come; then the usage chunk (an
    envelope of `chunk_object`) when asked for and every choice finished, the first error, and
    `data: [DONE]`. Chat and text completions stream this way."""
    endings: list[Done | Failed | None] = [None] * len(generations)
    try:
        streams = [choice_sse(turn, g, index, endings) for index, g in enumerate(generations)]
        async for frame in merged(streams):
            yield frame
    finally:
        for generation in generations:
            generation.cancel()  # a no-op for those that ended
    dones = [ending for ending in endings if isinstance(ending, Done)]
    if turn.include_usage and dones and len(dones) == len(endings):
        final = turn.envelope(chunk_object)
        final.update(choices=[], usage=usage_body(choices_usage([done.usage for done in dones])))
        yield sse_event(final)
    if (error := ending_error(endings)) is not None:
        yield sse_event(error_body(error, "openai"))
    yield SSE_DONE


def ending_error(endings: Sequence[Done | Failed | None]) -> ApiError | None:
    """The error the first choice that was cut short or failed ends the stream with, if any."""
    for ending in endings:
        if isinstance(ending, Failed):
            return failed_error(ending)
        if isinstance(ending, Done) and (cut := cut_short_error(ending)) is not None:
            return cut
    return None


async def _choice_sse(
    turn: ChatTurn, generation: Generation, index: int, endings: list[Done | Failed | None]
) -> AsyncIterator[bytes]:
    """One choice's chunks, up to its finish chunk; how it ended goes to `endings[index]`."""
    request = generation.request
    mode = request.tool_choice.mode if request.tools else "none"
    # The opening delta: `content` is null when a tool call follows, as OpenAI's is (a "" there
    # is an empty text part to Vercel's useChat). With `auto` that is known at the first event.
    opened = mode != "auto"
    if opened:
        opening = {"role": "assistant", "content": None if mode == "required" else ""}
        yield sse_event(turn.chunk(opening, index=index))
    async for event in generation.stream():
        if not opened and _shows(event):
            opened = True
            content = "" if isinstance(event, Delta) else None
            yield sse_event(turn.chunk({"role": "assistant", "content": content}, index=index))
        if isinstance(event, Delta) and (event.text or event.logprobs):
            logprobs = {"content": [logprob_body(lp) for lp in event.logprobs]} if event.logprobs else None
            yield sse_event(turn.chunk({"content": event.text}, logprobs=logprobs, index=index))
        elif isinstance(event, ReasoningDelta):
            yield sse_event(turn.chunk({"reasoning_content": event.text}, index=index))
        elif isinstance(event, ToolCallDelta):
            yield sse_event(turn.chunk({"tool_calls": [tool_call_part(event)]}, index=index))
        elif isinstance(event, Done):
            endings[index] = event
            finish = (
                CUT_SHORT_FINISH
                if cut_short_error(event)
                else FINISH_REASONS.get(event.finish_reason, "stop")
            )
            yield sse_event(turn.chunk({}, finish, index=index))
        elif isinstance(event, Failed):
            endings[index] = event


def _shows(event: object) -> bool:
    """Whether `event` is the answer's first output: text, reasoning, a call, or its end."""
    if isinstance(event, Delta):
        return bool(event.text or event.logprobs)
    return not isinstance(event, Queued | Started)


async def chat_complete(turn: ChatTurn, generations: Sequence[Generation]) -> dict[str, Any]:
    """Collect a request's choices into one `chat.completion` object.

    Raises:
        ApiError: 500 when the model failed mid-generation (as `collect_answers`).
    """
    answers = await collect_answers(generations)
    body = turn.envelope("chat.completion")
    body["choices"] = [
        _choice_body(answer, generation.request.sampling.logprobs is not None, index)
        for index, (answer, generation) in enumerate(zip(answers, generations, strict=True))
    ]
    body["usage"] = usage_body(choices_usage([answer.done.usage for answer in answers]))
    return body


def _choice_body(answer: Collected, with_logprobs: bool, index: int) -> dict[str, Any]:
    done = answer.done
    message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
    if done.tool_calls:
        message["content"] = answer.text or None
        message["tool_calls"] = [tool_call_body(call) for call in done.tool_calls]
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    logprobs = None
    if with_logprobs:
        logprobs = {"content": [logprob_body(lp) for lp in answer.logprobs], "refusal": None}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": FINISH_REASONS.get(done.finish_reason, "stop"),
    }


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
