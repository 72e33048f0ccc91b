"""Images on chat completions (issue 29): a real PNG through the tiny LLaVA, hostile images
refused with a 400 in OpenAI's envelope naming the part, and text models refusing images."""

from __future__ import annotations

import base64

import pytest

from tests.api.support import bearer, post_json
from tests.engine.test_images import pillow_image, png_of_size

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

PART = "messages[0].content[1].image_url"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def with_images(*urls: str, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


async def chat(api_key: str, model: str, messages: list[dict], **fields):
    body = {"model": model, "messages": messages, "max_tokens": 4, **fields}
    return await post_json("/v1/chat/completions", body, bearer(api_key))


def refusal(response, code: str, param: str = PART) -> str:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    return error["message"]


async def test_a_png_reaches_the_vision_model_and_counts_its_image_tokens(api_key, vision_alias, mlx_engine):
    from mlxhost.engine.backends.mlx.tiny_vision import IMAGE_TOKENS

    text_only = await chat(api_key, "tiny-vision", with_images())
    assert text_only.status_code == 200, text_only.content
    image = await chat(api_key, "tiny-vision", with_images(data_url(pillow_image((40, 30)))))
    assert image.status_code == 200, image.content
    body = image.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    # The template's `<image>\n` is one placeholder and a newline; the processor expands the
    # placeholder to the 16 tokens the vision tower gives one 32 x 32 image.
    extra = body["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"]
    assert extra == IMAGE_TOKENS + 1


async def test_two_different_images_give_different_answers_and_the_same_image_the_same(
    api_key, vision_alias, mlx_engine
):
    """The pixels reach the model: greedy answers follow the image, not only the text."""
    red, other = pillow_image((32, 32), (255, 0, 0)), pillow_image((32, 32), (0, 0, 0))
    answers = []
    for data in (red, other, red):
        response = await chat(
            api_key, "tiny-vision", with_images(data_url(data)), max_tokens=12, logprobs=True
        )
        assert response.status_code == 200, response.content
        answers.append([t["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"]])
    assert answers[0] == pytest.approx(answers[2])
    assert answers[0] != pytest.approx(answers[1])


async def test_a_text_alias_refuses_an_image_naming_its_kind(api_key, tiny_alias):
    message = refusal(
        await chat(api_key, "tiny", with_images(data_url(pillow_image()))), "images_not_supported"
    )
    assert "'tiny' is a chat model (kind 'chat')" in message


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        pytest.param(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "could not be read", id="truncated"),
        pytest.param(data_url(png_of_size(30_000, 30_000, rows=1)), "pixels allowed", id="huge-header"),
        pytest.param(data_url(png_of_size(5000, 5000, rows=2)), "5000 x 5000 pixels", id="over-pixels"),
        pytest.param(data_url(pillow_image(), "image/jpeg"), "sent as image/jpeg", id="wrong-mime"),
        pytest.param(data_url(b"GIF89a not really", "image/gif"), "could not be read", id="bad-gif"),
        pytest.param(data_url(b"%PDF-1.7", "application/pdf"), "not a PNG, JPEG", id="pdf"),
        pytest.param("data:image/png;base64,@@not-base64@@", "not valid base64", id="bad-base64"),
        pytest.param("http://127.0.0.1/cat.png", "remote image URLs are not fetched", id="remote"),
        pytest.param("file:///etc/passwd", "must be a base64 data URL", id="file-url"),
    ],
)
async def test_a_hostile_image_is_a_400_naming_the_part(
    api_key, vision_alias, mlx_engine, settings, url, needle
):
    settings.MLXHOST_IMAGE_MAX_PIXELS = 4096 * 4096
    assert needle in refusal(await chat(api_key, "tiny-vision", with_images(url)), "invalid_image")


async def test_too_many_images_and_too_many_bytes_are_refused(api_key, vision_alias, mlx_engine, settings):
    png = data_url(pillow_image())
    settings.MLXHOST_IMAGE_MAX_PER_REQUEST = 3
    message = refusal(
        await chat(api_key, "tiny-vision", with_images(*[png] * 100)),
        "invalid_image",
        "messages[0].content[4].image_url",
    )
    assert "at most 3 images; it has 100" in message
    big = pillow_image((200, 200), fmt="PNG", compress_level=0)  # about 120 kB
    settings.MLXHOST_IMAGE_MAX_BYTES = 50_000
    assert "larger than 50000 bytes" in refusal(
        await chat(api_key, "tiny-vision", with_images(data_url(big))), "invalid_image"
    )
    settings.MLXHOST_IMAGE_MAX_BYTES, settings.MLXHOST_IMAGE_MAX_TOTAL_BYTES = 200_000, 150_000
    message = refusal(
        await chat(api_key, "tiny-vision", with_images(data_url(big), data_url(big))),
        "invalid_image",
        "messages[0].content[2].image_url",
    )
    assert "more than 150000 bytes together" in message


async def test_an_image_outside_a_user_message_is_refused(api_key, vision_alias, mlx_engine):
    messages = [
        {
            "role": "system",
            "content": [{"type": "image_url", "image_url": {"url": data_url(pillow_image())}}],
        },
        {"role": "user", "content": "hi"},
    ]
    message = refusal(
        await chat(api_key, "tiny-vision", messages), "invalid_image", "messages[0].content[0].image_url"
    )
    assert "only user messages" in message


# Anthropic Messages: `image` blocks with a base64 source ------------------------------------------

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def image_block(data: bytes, media_type: str = "image/png") -> dict:
    source = {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


async def messages(api_key: str, model: str, *blocks: dict, path: str = "/v1/messages"):
    content = [*blocks, {"type": "text", "text": "What is in this picture?"}]
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    return await post_json(path, body, {"x-api-key": api_key, **ANTHROPIC})


def anthropic_refusal(response) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


async def test_a_messages_image_block_reaches_the_vision_model_and_counts_as_it_runs(
    api_key, vision_alias, mlx_engine
):
    block = image_block(pillow_image((40, 30)))
    answer = await messages(api_key, "tiny-vision", block)
    assert answer.status_code == 200, answer.content
    usage = answer.json()["usage"]
    assert usage["output_tokens"] == 4
    counted = await messages(api_key, "tiny-vision", block, path="/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.content
    assert counted.json()["input_tokens"] == usage["input_tokens"]


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        pytest.param(image_block(pillow_image(), "image/webp"), "sent as image/webp", id="wrong-mime"),
        pytest.param(image_block(png_of_size(30_000, 30_000, rows=1)), "pixels allowed", id="huge-header"),
        pytest.param(image_block(b"\x89PNG\r\n\x1a\n\0\0"), "could not be read", id="truncated"),
        pytest.param(
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}},
            "remote image URLs are not fetched",
            id="url",
        ),
    ],
)
async def test_a_hostile_messages_image_is_a_400_in_anthropics_envelope(
    api_key, vision_alias, mlx_engine, block, needle
):
    message = anthropic_refusal(await messages(api_key, "tiny-vision", block))
    assert message.startswith("messages[0].content[0].source: ") and needle in message


async def test_a_text_alias_refuses_a_messages_image(api_key, tiny_alias):
    message = anthropic_refusal(await messages(api_key, "tiny", image_block(pillow_image())))
    assert "kind 'chat'" in message and "reads no images" in message
