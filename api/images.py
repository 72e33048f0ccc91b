"""Images in request bodies (docs/api.md#images): each surface's image parts read into engine
`Image`s, their bytes and count bounded by the settings before anything is decoded."""

from __future__ import annotations

import binascii
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rest_framework import serializers

from mlxhost.engine import Image, ImageLimits, InvalidImageError, check_encoded
from models_app.turns import images as image_limits

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine import Message

DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*);base64,", re.I)
REMOTE_REFUSED = "remote image URLs are not fetched by this server; send the image inline as {inline}."


def image_from_base64(data: Any, media_type: str, param: str, limits: ImageLimits) -> Image:
    """An `Image` of base64 text, checked (size, format, declared type) but not decoded.

    Raises:
        InvalidImageError: not base64, over the size limit, or not a supported image format.
    """
    if not isinstance(data, str) or not data:
        raise InvalidImageError(param, "the image data must be a non-empty base64 string.")
    if len(data) // 4 * 3 > limits.max_bytes + 2:  # refused before decoding the text
        raise InvalidImageError(param, f"the image is larger than {limits.max_bytes} bytes.")
    try:
        encoded = binascii.a2b_base64(data.strip(), strict_mode=True)
    except binascii.Error as exc:
        raise InvalidImageError(param, f"the image data is not valid base64 ({exc}).") from exc
    image = Image(param=param, encoded=encoded, media_type=media_type)
    check_encoded(image, limits)
    return image


def image_from_url(url: Any, param: str, limits: ImageLimits) -> Image:
    """An `Image` of an OpenAI `image_url.url`: a base64 data URL. Remote URLs are refused.

    Raises:
        InvalidImageError: a remote or malformed URL, or as `image_from_base64`.
    """
    if not isinstance(url, str) or not url:
        raise InvalidImageError(param, "the image URL must be a non-empty string.")
    if url[:8].lower().startswith(("http://", "https://")):
        raise InvalidImageError(param, REMOTE_REFUSED.format(inline="a data URL (data:image/png;base64,...)"))
    match = DATA_URL.match(url)
    if match is None:
        raise InvalidImageError(param, "the image URL must be a base64 data URL (data:image/png;base64,...).")
    return image_from_base64(url[match.end() :], match.group("type") or "", param, limits)


def bound_images(messages: Sequence[Message], limits: ImageLimits) -> None:
    """A request's images together: at most `max_images`, at most `max_total_bytes` of files.

    Raises:
        InvalidImageError: naming the first image over either bound.
    """
    bound_read([image for message in messages for image in message.images], limits)


def bound_read(images: Sequence[Image], limits: ImageLimits) -> None:
    """`bound_images` of images read, in the request's order."""
    total = 0
    for index, image in enumerate(images):
        if index >= limits.max_images:
            raise InvalidImageError(
                image.param, f"a request may hold at most {limits.max_images} images; it has {len(images)}."
            )
        total += len(image.encoded)
        if total > limits.max_total_bytes:
            raise InvalidImageError(
                image.param, f"the request's images have more than {limits.max_total_bytes} bytes together."
            )


def count_images(
    counts: Sequence[int], limits: ImageLimits, field: str, leaf: str, parts: Sequence[int] | None = None
) -> None:
    """Refuse a request with more than `max_images` images before any is read: `counts[i]` is
    message i's; the error names the first image over the bound (`parts`: every image's part index
    in order, else its place among its message's images).

    Raises:
        InvalidImageError: too many images.
    """
    total = sum(counts)
    if total <= limits.max_images:
        return
    places = [(index, n) for index, count in enumerate(counts) for n in range(count)]
    index, nth = places[limits.max_images]
    part = parts[limits.max_images] if parts is not None else nth
    raise InvalidImageError(
        f"messages[{index}].{field}[{part}]{leaf}",
        f"a request may hold at most {limits.max_images} images; it has {total}.",
    )


def stored_form(image: Image) -> dict[str, str]:
    """An image read from a request as a stored turn keeps it (JSON): its declared type, its file
    in base64 and the part that held it. `models_app.turns.images.stored_image` reads it back."""
    data = binascii.b2a_base64(image.encoded, newline=False).decode()
    return {"media_type": image.media_type, "data": data, "param": image.param}


def anthropic_image(block: dict[str, Any], param: str, limits: ImageLimits) -> Image:
    """An Anthropic `image` block's `Image`: a `base64` source with its `media_type`; `url`
    sources are refused (remote images are not fetched).

    Raises:
        InvalidImageError: a URL or malformed source, or as `image_from_base64`.
    """
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        raise InvalidImageError(param, REMOTE_REFUSED.format(inline="a base64 source"))
    if kind != "base64" or not isinstance(source, dict):
        raise InvalidImageError(
            param, 'an image block needs a source {"type": "base64", "media_type", "data"}.'
        )
    media_type = source.get("media_type")
    return image_from_base64(
        source.get("data"), media_type if isinstance(media_type, str) else "", param, limits
    )


def openai_content(value: Any) -> tuple[str, tuple[Any, ...]]:
    """An OpenAI message's content: its text (the text parts joined) and its `image_url` parts'
    URLs by part index, as `(index, url)`, read later by `openai_images` (which knows the
    message's place, for errors).

    Raises:
        serializers.ValidationError: a part that is neither text nor an image.
    """
    if isinstance(value, str):
        return value, ()
    if not isinstance(value, list):
        raise serializers.ValidationError("Content must be a string or a list of content parts.")
    texts, urls = [], []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            source = part.get("image_url")
            urls.append((index, source.get("url") if isinstance(source, dict) else source))
        else:
            raise serializers.ValidationError(
                f"content[{index}]: only text and image_url content parts are supported."
            )
    return "".join(texts), tuple(urls)


def openai_images(messages: Sequence[Message], urls: Sequence[tuple[Any, ...]]) -> tuple[Message, ...]:
    """`messages` with their image parts read (`urls[i]` from `openai_content` of message i) and
    every bound checked; only user messages may hold images.

    Raises:
        InvalidImageError: as `image_from_url` and `bound_images`; an image outside a user message.
    """
    limits = image_limits.limits()
    count_images(
        [len(parts) for parts in urls], limits, "content", ".image_url", [p for u in urls for p, _ in u]
    )
    out = []
    for index, (message, parts) in enumerate(zip(messages, urls, strict=True)):
        params = [f"messages[{index}].content[{part}].image_url" for part, _ in parts]
        if parts and message.role != "user":
            raise InvalidImageError(params[0], "only user messages may hold images.")
        images = tuple(
            image_from_url(url, param, limits) for param, (_, url) in zip(params, parts, strict=True)
        )
        out.append(replace(message, images=images) if images else message)
    bound_images(out, limits)
    return tuple(out)
