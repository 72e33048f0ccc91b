"""Collecting a generation into its whole text, for the non-streaming answer of every surface."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.errors import ApiError, cut_short_error, failed_error
from mlxhost.engine import Delta, Done, Failed

if TYPE_CHECKING:
    from mlxhost.engine import Generation

NO_RESULT = "The generation ended without a result."


async def collect_text(generation: Generation) -> tuple[str, Done]:
    """The generation's text and its `Done` event.

    Raises:
        ApiError: the model failed mid-generation (503 for a load failure, else 500), the answer was
            cut short (409 cancelled, 503 draining), or the stream ended without a result.
    """
    parts: list[str] = []
    async for event in generation.stream():
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise failed_error(event)
        elif isinstance(event, Done):
            if (error := cut_short_error(event)) is not None:
                raise error  # no header is out yet: a partial answer is a status, not a 200
            return "".join(parts), event
    raise ApiError(500, NO_RESULT, "server_error", "generation_failed")
