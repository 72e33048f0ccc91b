"""Vision turns in the engine (issue 29), on the fake backend: images reach the model's exclusive
generation, a vision lane serves one request at a time, a prompt with images neither uses nor
fills the prefix cache, and a model of another kind refuses images."""

from __future__ import annotations

import pytest

from mlxhost.engine import Done, Image, ImagesNotSupportedError, LaneSettings, Message, SessionQuery
from tests.engine.conftest import collect, lane_of, request, spec

PIXEL = Image(
    param="messages[0].content[1].image_url", pixels=b"\x10\x20\x30", width=1, height=1, digest="d1"
)
SESSION = SessionQuery(domain="d", instructions="i", warm_any=True)


def vision_spec(**overrides):
    return spec(kind="vision", lane=LaneSettings(capacity=4, queue_depth=8), **overrides)


def with_image(text: str = "what is this?") -> tuple[Message, ...]:
    return (Message(role="user", content=text, images=(PIXEL,)),)


async def test_a_vision_turn_hands_its_images_to_the_model_and_counts_them_in_the_prompt(engine, backend):
    backend.enqueue(["a", "b"])
    events = await collect(await engine.submit(request(messages=with_image(), spec_=vision_spec())))
    assert isinstance(events[-1], Done)
    assert backend.images == [(PIXEL,)]
    rendered = backend.renders[-1][0]
    assert rendered[0].images == (PIXEL,)
    # The fake renders `<image WxH>` where the image goes: its tokens count in the prompt.
    assert events[-1].usage.prompt_tokens == len("<user><image 1x1>what is this?<assistant>")


async def test_a_vision_lane_serves_one_request_at_a_time_whatever_its_capacity(engine, backend):
    backend.enqueue(["x"])
    await collect(await engine.submit(request(spec_=vision_spec())))
    assert lane_of(engine)["capacity"] == 1


async def test_a_prompt_with_images_neither_uses_nor_fills_the_prefix_cache(engine, backend):
    vision = vision_spec()
    for name in ("first", "second"):
        backend.enqueue(["x"])
        generation = await engine.submit(request(name, messages=with_image(), spec_=vision, session=SESSION))
        events = await collect(generation)
        assert events[-1].usage.cached_tokens == 0
        assert generation.request.session is None
    assert backend.contexts[-1] == []  # the whole prompt was fed, images and all
    # The same two turns without the image do reuse the first one's prefix.
    for name in ("text-1", "text-2"):
        backend.enqueue(["x"])
        events = await collect(
            await engine.submit(request(name, text="what is this?", spec_=vision, session=SESSION))
        )
    assert events[-1].usage.cached_tokens > 0


async def test_a_chat_model_refuses_images_in_the_engine_too(engine, backend):
    with pytest.raises(ImagesNotSupportedError) as caught:
        await engine.submit(request(messages=with_image(), spec_=spec()))
    assert caught.value.code == "images_not_supported"
    assert "kind 'chat'" in str(caught.value)
    assert lane_of(engine)["permits"] == 0 and lane_of(engine)["active"] == 0
