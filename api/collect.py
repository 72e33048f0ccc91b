"""Collecting a generation into its whole text, for the non-streaming answer of every surface."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.errors import ApiError
from mlxhost.engine import Delta, Done, Failed

if TYPE_CHECKING:
    from mlxhost.engine import Generation

NO_RESULT = "The generation ended without a result."


async def collect_text(generation: Generation) -> tuple[str, Done]:
    """The generation's text and its `Done` event.

    Raises:
        ApiError: 500 when the model failed mid-generation or the stream ended without a result.
    """
    parts: list[str] = []
    async for event in generation.stream():
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise ApiError(500, event.message, "server_error", event.code)
        elif isinstance(event, Done):
            return "".join(parts), event
    raise ApiError(500, NO_RESULT, "server_error", "generation_failed")
