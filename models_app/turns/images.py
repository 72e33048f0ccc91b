"""A turn's images (issue 29): refused for a model that reads none, else decoded off the event
loop, a few at a time (`MLXHOST_IMAGE_DECODE_THREADS`), before the turn takes a lane permit."""

from __future__ import annotations

import asyncio
import binascii
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from django.conf import settings

from mlxhost.engine import Image, ImageLimits, ImagesNotSupportedError, decode_image, request_images
from models_app.models import Model

if TYPE_CHECKING:
    from mlxhost.engine import Message
    from models_app.models import ModelAlias

_decoder: ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def decoder() -> ThreadPoolExecutor:
    """The process's image decoding threads, started on first use."""
    global _decoder
    with _decoder_lock:
        if _decoder is None:
            _decoder = ThreadPoolExecutor(
                max_workers=settings.MLXHOST_IMAGE_DECODE_THREADS, thread_name_prefix="mlxhost-image-decode"
            )
        return _decoder


def limits() -> ImageLimits:
    """The limits in force (`MLXHOST_IMAGE_*`, docs/configuration.md)."""
    return ImageLimits(
        max_bytes=settings.MLXHOST_IMAGE_MAX_BYTES,
        max_pixels=settings.MLXHOST_IMAGE_MAX_PIXELS,
        max_images=settings.MLXHOST_IMAGE_MAX_PER_REQUEST,
        max_total_bytes=settings.MLXHOST_IMAGE_MAX_TOTAL_BYTES,
    )


async def turn_images(alias: ModelAlias, messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """A turn's `messages` with their images decoded, when `alias` names a vision model;
    unchanged without images.

    Raises:
        ImagesNotSupportedError: the turn has images and the alias's model is not a vision model.
        InvalidImageError: an image over the pixel limit, or unreadable (`decode_image`).
    """
    images = request_images(messages)
    if not images:
        return messages
    if alias.model.kind != Model.Kind.VISION:
        raise ImagesNotSupportedError(alias.name, alias.model.kind, param=images[0].param)
    loop, bounds = asyncio.get_running_loop(), limits()
    decoded = iter(
        await asyncio.gather(*(loop.run_in_executor(decoder(), decode_image, i, bounds) for i in images))
    )
    return tuple(
        replace(m, images=tuple(next(decoded) for _ in m.images)) if m.images else m for m in messages
    )


def stored_image(stored: dict[str, Any], param: str) -> Image:
    """An image of a stored turn (`api.images.stored_form`: its declared type and its file in
    base64) as the engine's `Image`, to be decoded again for a replay of the chain."""
    return Image(
        param=param, encoded=binascii.a2b_base64(stored["data"]), media_type=stored.get("media_type", "")
    )
