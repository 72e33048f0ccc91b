"""Images (issue 29): each file checked before decoding, the pixel bound read from its header,
hostile files refused with the part named; and the vision extra imported only where needed."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib
from typing import TYPE_CHECKING

import pytest

from mlxhost.engine import Image, ImageLimits, InvalidImageError, decode_image, detect_kind
from mlxhost.engine.images import check_encoded

if TYPE_CHECKING:
    from pathlib import Path

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=256 * 256, max_images=4, max_total_bytes=2 << 20)
PARAM = "messages[0].content[1].image_url"


def pillow_image(size=(20, 10), color=(200, 30, 40), fmt="PNG", **save) -> bytes:
    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.new("RGB", size, color).save(out, format=fmt, **save)
    return out.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_of_size(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale PNG whose header says `width` x `height`; its data holds `rows` zero rows
    (all of them by default: a zip bomb, megabytes of pixels in kilobytes of file)."""
    compressor, parts = zlib.compressobj(9), []
    row = b"\0" * (width + 1)
    for _ in range(height if rows is None else rows):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", b"".join(parts))
        + png_chunk(b"IEND", b"")
    )


def image(data: bytes, media_type: str = "") -> Image:
    return Image(param=PARAM, encoded=data, media_type=media_type)


def refused(data: bytes, media_type: str = "", limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(InvalidImageError) as caught:
        decode_image(image(data, media_type), limits)
    assert caught.value.param == PARAM
    assert str(caught.value).startswith(PARAM)
    return str(caught.value)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_decodes_to_rgb_pixels_with_their_digest(fmt):
    decoded = decode_image(image(pillow_image(fmt=fmt), f"image/{fmt.lower()}"), LIMITS)
    assert (decoded.width, decoded.height, len(decoded.pixels)) == (20, 10, 20 * 10 * 3)
    assert decoded.encoded == b"" and decoded.decoded and len(decoded.digest) == 64
    other = decode_image(image(pillow_image(color=(0, 0, 255), fmt=fmt)), LIMITS)
    assert other.digest != decoded.digest


def test_a_gif_gives_its_first_frame_only():
    from PIL import Image as PILImage

    frames = [PILImage.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image(image(out.getvalue(), "image/gif"), LIMITS)
    first = decode_image(image(pillow_image((8, 8), (255, 0, 0), "GIF")), LIMITS)
    assert decoded.pixels == first.pixels


def test_a_gif_of_ten_thousand_frames_decodes_its_first_frame_and_seeks_no_other(monkeypatch):
    """A small file (420 kB) of 10,000 frames costs one frame: Pillow is asked for frame 0 only,
    never to walk the others (which a frame count or a seek past it would do)."""
    from PIL import GifImagePlugin
    from PIL import Image as PILImage

    palette = [255, 0, 0, 0, 0, 255] + [0] * 762
    frames = [PILImage.new("P", (4, 4), i % 2) for i in range(10_000)]
    for frame in frames:
        frame.putpalette(palette)
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    assert len(out.getvalue()) < LIMITS.max_bytes
    seeks: list[int] = []
    real_seek = GifImagePlugin.GifImageFile._seek

    def counted(self, frame, *args, **kwargs):
        seeks.append(frame)
        return real_seek(self, frame, *args, **kwargs)

    monkeypatch.setattr(GifImagePlugin.GifImageFile, "_seek", counted)
    decoded = decode_image(image(out.getvalue(), "image/gif"), LIMITS)
    assert (decoded.width, decoded.height) == (4, 4)
    assert decoded.pixels == bytes([255, 0, 0]) * 16  # frame 0's red
    assert seeks == [0]


def test_a_truncated_file_is_refused_not_padded():
    data = pillow_image((64, 64), fmt="PNG", compress_level=0)
    assert "could not be read" in refused(data[: len(data) // 2])


def test_a_huge_size_in_a_tiny_header_is_refused_before_any_pixel_is_decoded():
    data = png_of_size(30_000, 30_000, rows=1)  # 900 M pixels claimed in a few hundred bytes
    assert len(data) < 1000
    assert f"more than the {LIMITS.max_pixels} pixels allowed" in refused(data)


def test_a_zip_bomb_png_is_refused_by_its_header():
    data = png_of_size(2000, 2000)  # 4 M pixels of zeros in a few kilobytes
    assert len(data) < 20_000
    assert "2000 x 2000 pixels" in refused(data)


def test_a_wrong_declared_type_and_a_non_image_are_refused_before_decoding():
    assert "sent as image/jpeg" in refused(pillow_image(fmt="PNG"), "image/jpeg")
    assert "not a PNG, JPEG, WebP or GIF image" in refused(b"PK\x03\x04 a zip file, not an image")
    assert "not a PNG, JPEG, WebP or GIF image" in refused(b"<svg xmlns='http://www.w3.org/2000/svg'/>")


def test_a_file_over_the_byte_limit_is_refused_before_decoding():
    small = ImageLimits(max_bytes=100, max_pixels=LIMITS.max_pixels, max_images=4, max_total_bytes=1000)
    data = pillow_image((64, 64), fmt="PNG", compress_level=0)
    with pytest.raises(InvalidImageError, match="at most 100 are allowed"):
        check_encoded(image(data), small)


def test_a_vision_config_is_detected_as_the_vision_kind(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "llava", "vision_config": {"image_size": 32}}')
    assert detect_kind(tmp_path) == "vision"
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    assert detect_kind(tmp_path) == "chat"


BLOCKED = "import sys; sys.modules['mlx_vlm'] = None  # as if the vision extra were not installed\n"


def test_without_the_vision_extra_the_app_imports_and_a_vision_load_says_what_to_install(tmp_path: Path):
    """mlx_vlm is imported only when a vision model loads: with it missing, the app (settings,
    URLs, every surface) imports as before, and loading a vision model names the make target."""
    code = BLOCKED + (
        "import os, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'mlxhost.settings_test')\n"
        "django.setup()\n"
        "import mlxhost.urls, api.images, models_app.turns.images\n"
        "from pathlib import Path\n"
        "from mlxhost.engine import ModelLoadError, ModelSpec\n"
        "from mlxhost.engine.backends.mlx.tiny import build_tiny_model\n"
        f"folder = build_tiny_model(Path({str(tmp_path / 'm')!r}))\n"
        "spec = ModelSpec(instance_id=1, source=str(folder), fingerprint='x', kind='vision')\n"
        "from mlxhost.engine.backends import make_backend\n"
        "try:\n"
        "    make_backend('mlx').load(spec, lambda *a, **k: None)\n"
        "except ModelLoadError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "REFUSED Vision models need the optional vision extra" in result.stdout
    assert "make install-vision" in result.stdout
