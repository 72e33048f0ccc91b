"""End to end (issue 29): the official `openai` SDK sends a real PNG to the tiny LLaVA through a
real daphne process and gets 200 with usage; a text alias refuses the same image with a 400."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.engine.test_images import pillow_image

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def client(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def png_message() -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(pillow_image((48, 40), (10, 120, 200))).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe the picture."},
                {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            ],
        }
    ]


def test_the_sdk_sends_a_png_and_gets_an_answer_with_usage(client, vision_alias):
    from mlxhost.engine.backends.mlx.tiny_vision import IMAGE_TOKENS

    answer = client.chat.completions.create(model="tiny-vision", messages=png_message(), max_tokens=6)
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 6
    assert answer.usage.prompt_tokens > IMAGE_TOKENS  # the image's tokens and the text's
    stream = client.chat.completions.create(
        model="tiny-vision",
        messages=png_message(),
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens


def test_a_text_alias_refuses_the_image_through_the_sdk(client, tiny_alias):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=png_message(), max_tokens=6)
    assert caught.value.code == "images_not_supported"
    assert "kind 'chat'" in caught.value.message


def test_the_anthropic_sdk_sends_an_image_block_and_gets_an_answer_with_usage(
    daphne_server, api_key, vision_alias
):
    import anthropic

    client = anthropic.Anthropic(base_url=daphne_server.url, api_key=api_key, max_retries=0, timeout=60)
    data = base64.b64encode(pillow_image((48, 40), (10, 120, 200))).decode()
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Describe the picture."},
    ]
    message = client.messages.create(
        model="tiny-vision", max_tokens=6, messages=[{"role": "user", "content": content}]
    )
    assert message.role == "assistant" and message.usage.output_tokens == 6
    counted = client.messages.count_tokens(
        model="tiny-vision", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="tiny-vision",
            max_tokens=6,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {**content[0], "source": {**content[0]["source"], "media_type": "image/gif"}}
                    ],
                }
            ],
        )
    assert "sent as image/gif" in caught.value.message


def test_the_sdk_sends_an_input_image_to_responses_and_continues_the_chain(client, vision_alias):
    """`responses.create` with an `input_image` part, streamed and not; a continuation by
    `previous_response_id` replays the stored image (its prompt holds the image's tokens again)."""
    from mlxhost.engine.backends.mlx.tiny_vision import IMAGE_TOKENS

    url = "data:image/png;base64," + base64.b64encode(pillow_image((48, 40), (10, 120, 200))).decode()
    content = [
        {"type": "input_text", "text": "Describe the picture."},
        {"type": "input_image", "image_url": url},
    ]
    item = {"role": "user", "content": content}
    first = client.responses.create(model="tiny-vision", input=[item], max_output_tokens=6, temperature=0)
    assert first.usage.input_tokens > IMAGE_TOKENS
    events = list(
        client.responses.create(
            model="tiny-vision", input=[item], max_output_tokens=6, temperature=0, store=False, stream=True
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == first.output_text  # greedy: the same answer either way
    second = client.responses.create(
        model="tiny-vision", input="And its colour?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(first.id, include=["message.input_image.image_url"])
    assert [part.type for part in items.data[0].content] == ["input_text", "input_image"]
    assert items.data[0].content[1].image_url == url
