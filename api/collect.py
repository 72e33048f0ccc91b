"""Collecting a generation into its whole text, for the non-streaming answer of every surface."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from api.errors import ApiError, cut_short_error, failed_error
from mlxhost.engine import Delta, Done, Failed

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine import Generation, TokenLogprob

NO_RESULT = "The generation ended without a result."


@dataclass
class Collected:
    """A whole answer: its text, its `Done` (with tool calls and reasoning), and its logprobs."""

    text: str
    done: Done
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect_text(generation: Generation) -> tuple[str, Done]:
    """The generation's text and its `Done` event (see `collect_answer`)."""
    answer = await collect_answer(generation)
    return answer.text, answer.done


async def collect_answer(generation: Generation) -> Collected:
    """The generation's whole answer.

    Raises:
        ApiError: the model failed mid-generation (503 for a load failure, else 500), the answer was
            cut short (409 cancelled, 503 draining), or the stream ended without a result.
    """
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in generation.stream():
        if isinstance(event, Delta):
            parts.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, Failed):
            raise failed_error(event)
        elif isinstance(event, Done):
            if (error := cut_short_error(event)) is not None:
                raise error  # no header is out yet: a partial answer is a status, not a 200
            return Collected("".join(parts), event, logprobs)
    raise ApiError(500, NO_RESULT, "server_error", "generation_failed")


async def collect_answers(generations: Sequence[Generation]) -> list[Collected]:
    """Every choice's whole answer, in order (OpenAI `n`); one that fails or is cut short raises
    as `collect_answer` does, and the others are cancelled."""
    if len(generations) == 1:
        return [await collect_answer(generations[0])]
    try:
        return list(await asyncio.gather(*(collect_answer(g) for g in generations)))
    finally:
        for generation in generations:
            generation.cancel()  # a no-op for those that ended
