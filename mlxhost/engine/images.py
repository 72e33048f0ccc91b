"""Images in requests (docs/api.md#images): their limits, and each file checked and decoded to RGB
pixels, the size read from the header before any pixel is decoded (decompression bombs)."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlxhost.engine.errors import InvalidImageError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine.types import Image, Message

# The formats read, by their files' first bytes; a GIF gives its first frame.
FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}
SUPPORTED = "PNG, JPEG, WebP or GIF"
PILLOW_MISSING = "Pillow is not installed on this server: install the vision extra (make install-vision)."


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images may be (settings `MLXHOST_IMAGE_*`, docs/configuration.md)."""

    max_bytes: int  # one image's file
    max_pixels: int  # one image's width times height, read from its header
    max_images: int  # per request, every message together
    max_total_bytes: int  # every image file of a request together


def sniff_format(data: bytes) -> str | None:
    """The format a file's first bytes say it is, one of `FORMATS`; None for any other."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def check_encoded(image: Image, limits: ImageLimits) -> str:
    """Check a file before decoding: its size, its format by its first bytes, and that the media
    type the request declared (if any) is that format's. Returns the format.

    Raises:
        InvalidImageError: over `max_bytes`, not a supported format, or declared as another type.
    """
    if len(image.encoded) > limits.max_bytes:
        raise InvalidImageError(
            image.param, f"the image has {len(image.encoded)} bytes; at most {limits.max_bytes} are allowed."
        )
    found = sniff_format(image.encoded)
    if found is None:
        raise InvalidImageError(image.param, f"the data is not a {SUPPORTED} image.")
    declared = image.media_type.lower()
    if declared and declared != FORMATS[found] and not (found == "jpeg" and declared == "image/jpg"):
        raise InvalidImageError(
            image.param, f"the data is a {FORMATS[found]} image, but it was sent as {image.media_type}."
        )
    return found


def decode_image(image: Image, limits: ImageLimits) -> Image:
    """`image` decoded: its RGB pixels, size and their SHA-256, the file dropped. Blocking (run it
    off the event loop). The header's size is checked before anything is decoded, so a small file
    that claims 30k x 30k pixels is refused without allocating them; a truncated or corrupt file
    is refused, never padded (Pillow's `LOAD_TRUNCATED_IMAGES` stays off).

    Raises:
        InvalidImageError: see `check_encoded`; more than `max_pixels`; unreadable.
    """
    found = check_encoded(image, limits)
    try:
        from PIL import Image as PILImage
        from PIL import UnidentifiedImageError
    except ImportError as exc:
        raise InvalidImageError(image.param, PILLOW_MISSING) from exc
    try:
        with PILImage.open(io.BytesIO(image.encoded), formats=[found.upper()]) as opened:
            width, height = opened.size  # from the header: nothing decoded yet
            if width <= 0 or height <= 0 or width * height > limits.max_pixels:
                raise InvalidImageError(
                    image.param,
                    f"the image is {width} x {height} pixels; at most {limits.max_pixels} pixels are allowed.",
                )
            opened.seek(0)  # a GIF's (or an animated WebP's) first frame only
            rgb = opened.convert("RGB")  # decodes that frame, and only it
    except InvalidImageError:
        raise
    except PILImage.DecompressionBombError as exc:  # Pillow's own bound, far above ours, at open
        raise InvalidImageError(
            image.param, f"the image has more than the {limits.max_pixels} pixels allowed ({exc})."
        ) from exc
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError) as exc:
        raise InvalidImageError(image.param, f"the {found.upper()} image could not be read ({exc}).") from exc
    pixels = rgb.tobytes()
    return replace(
        image,
        encoded=b"",
        pixels=pixels,
        width=width,
        height=height,
        digest=hashlib.sha256(f"{width}x{height}:".encode() + pixels).hexdigest(),
    )


def request_images(messages: Sequence[Message]) -> tuple[Image, ...]:
    """Every image of `messages`, in order."""
    return tuple(image for message in messages for image in message.images)
