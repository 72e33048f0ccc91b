"""Images on the Responses API (issue 29): `input_image` parts reach the vision model, are stored
with the turn so a continuation replays them, are listed as input items, and hostile ones are
refused with a 400 naming the part."""

from __future__ import annotations

import json

import pytest
from django.test import AsyncClient

from tests.api.support import bearer, post_json
from tests.api.test_images import data_url
from tests.api.test_images import refusal as chat_refusal
from tests.engine.test_images import pillow_image

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

PART = "input[0].content[1].image_url"


def image_input(*urls: str, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "input_text", "text": text}]
    parts += [{"type": "input_image", "image_url": url, "detail": "auto"} for url in urls]
    return [{"type": "message", "role": "user", "content": parts}]


async def respond(api_key: str, model: str, input_: object, **fields):
    body = {"model": model, "input": input_, "max_output_tokens": 6, "temperature": 0, **fields}
    return await post_json("/v1/responses", body, bearer(api_key))


def refusal(response, code: str, param: str = PART) -> str:
    return chat_refusal(response, code, param)


def text_of(body: dict) -> str:
    return "".join(
        part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]
    )


def logprobs(body: dict) -> list[float]:
    parts = [part for item in body["output"] if item["type"] == "message" for part in item["content"]]
    return [entry["logprob"] for part in parts for entry in part.get("logprobs") or []]


async def test_an_input_image_reaches_the_vision_model(api_key, vision_alias, mlx_engine):
    """API-15: an input_image part is read into the prompt as the model's image tokens."""
    from mlxhost.engine.backends.mlx.tiny_vision import IMAGE_TOKENS

    text_only = await respond(api_key, "tiny-vision", image_input())
    assert text_only.status_code == 200, text_only.content
    image = await respond(api_key, "tiny-vision", image_input(data_url(pillow_image((40, 30)))))
    assert image.status_code == 200, image.content
    extra = image.json()["usage"]["input_tokens"] - text_only.json()["usage"]["input_tokens"]
    assert extra == IMAGE_TOKENS + 1  # the placeholder expanded, and its newline


async def test_a_continuation_replays_the_stored_image(api_key, vision_alias, mlx_engine):
    """The image is stored with its turn: a continuation by id gives the same answer as sending
    the whole conversation again with the image, and another image gives another answer."""
    include = ["message.output_text.logprobs"]
    red, black = data_url(pillow_image((32, 32), (255, 0, 0))), data_url(pillow_image((32, 32), (0, 0, 0)))
    first = await respond(api_key, "tiny-vision", image_input(red), include=include)
    assert first.status_code == 200, first.content
    follow = [{"type": "message", "role": "user", "content": "And its colour?"}]
    chained = await respond(
        api_key, "tiny-vision", follow, previous_response_id=first.json()["id"], include=include
    )
    assert chained.status_code == 200, chained.content

    def whole(url: str) -> list[dict]:
        answer = {"type": "message", "role": "assistant", "content": text_of(first.json())}
        return [*image_input(url), answer, *follow]

    resent = await respond(api_key, "tiny-vision", whole(red), include=include)
    other = await respond(api_key, "tiny-vision", whole(black), include=include)
    assert logprobs(chained.json()) == pytest.approx(logprobs(resent.json()))
    assert logprobs(chained.json()) != pytest.approx(logprobs(other.json()))


async def test_input_items_list_the_image_and_its_url_only_when_included(api_key, vision_alias, mlx_engine):
    url = data_url(pillow_image((32, 32)))
    created = await respond(api_key, "tiny-vision", image_input(url))
    assert created.status_code == 200, created.content
    path = f"/v1/responses/{created.json()['id']}/input_items"
    client = AsyncClient()
    plain = (await client.get(path, headers=bearer(api_key))).json()["data"][0]["content"]
    assert [p["type"] for p in plain] == ["input_text", "input_image"]
    assert plain[1]["image_url"] is None
    full = (await client.get(f"{path}?include=message.input_image.image_url", headers=bearer(api_key))).json()
    assert full["data"][0]["content"][1]["image_url"] == url


async def test_a_text_alias_refuses_an_input_image(api_key, tiny_alias):
    message = refusal(
        await respond(api_key, "tiny", image_input(data_url(pillow_image()))), "images_not_supported"
    )
    assert "'tiny' is a chat model" in message


@pytest.mark.parametrize(
    ("part", "param", "needle"),
    [
        pytest.param(
            {"type": "input_image", "image_url": "https://example.com/cat.png"},
            PART,
            "remote image URLs are not fetched",
            id="remote",
        ),
        pytest.param(
            {"type": "input_image", "file_id": "file-123"},
            "input[0].content[1].file_id",
            "files are not stored",
            id="file-id",
        ),
        pytest.param(
            {"type": "input_image", "image_url": "data:image/png;base64,@@"},
            PART,
            "not valid base64",
            id="bad-base64",
        ),
        pytest.param(
            {"type": "input_image", "image_url": data_url(b"%PDF-1.7", "application/pdf")},
            PART,
            "not a PNG, JPEG",
            id="pdf",
        ),
    ],
)
async def test_a_hostile_input_image_is_a_400_naming_the_part(
    api_key, vision_alias, mlx_engine, part, param, needle
):
    body = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}, part]}]
    assert needle in refusal(await respond(api_key, "tiny-vision", body), "invalid_image", param)


async def test_too_many_input_images_and_images_outside_a_user_turn_are_refused(
    api_key, vision_alias, mlx_engine, settings
):
    settings.MLXHOST_IMAGE_MAX_PER_REQUEST = 2
    url = data_url(pillow_image((32, 32)))
    message = refusal(
        await respond(api_key, "tiny-vision", image_input(url, url, url)),
        "invalid_image",
        "input[0].content[3].image_url",
    )
    assert "at most 2 images" in message
    assistant = [
        {"type": "message", "role": "assistant", "content": [{"type": "input_image", "image_url": url}]}
    ]
    assert "only user messages" in refusal(
        await respond(api_key, "tiny-vision", assistant), "invalid_image", "input[0].content[0].image_url"
    )


async def test_an_input_image_over_the_websocket_and_a_hostile_one_as_an_error_frame(
    api_key, vision_alias, mlx_engine
):
    """The socket reads images as POST /v1/responses does (within MLXHOST_WS_MAX_FRAME_BYTES): the
    same prompt tokens, and a bad image an error frame naming the part, the socket still usable."""
    from tests.api.support import WS_TERMINAL, connect, frames_until, key_headers, ws_create

    url = data_url(pillow_image((40, 30)))
    http = await respond(api_key, "tiny-vision", image_input(url), store=False)
    socket = await connect(key_headers(api_key))
    await ws_create(
        socket, model="tiny-vision", input=image_input("data:image/png;base64,@@"), max_output_tokens=6
    )
    error = json.loads(await socket.receive_from(timeout=30))
    assert (error["type"], error["status"], error["error"]["param"]) == ("error", 400, PART)
    await ws_create(
        socket, model="tiny-vision", input=image_input(url), max_output_tokens=6, temperature=0, store=False
    )
    final = (await frames_until(socket, *WS_TERMINAL))[-1]["response"]
    assert final["usage"]["input_tokens"] == http.json()["usage"]["input_tokens"]
    assert final["output"][0]["content"][0]["text"] == text_of(http.json())
    await socket.disconnect()
