"""End to end: a real daphne process, the official `anthropic` SDK, the tiny real MLX model."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e.conftest import endless, holding_stream, instance_snapshot, set_lane
from tests.support import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def client(daphne_server, api_key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daphne_server.url, api_key=api_key, max_retries=0, timeout=60)


def test_sdk_creates_a_message(client, tiny_alias):
    """API-2: `messages.create` parses our `message` object."""
    message = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, system="Be brief.")
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_")
    assert (message.role, message.model, message.stop_reason) == ("assistant", "tiny", "max_tokens")
    assert [block.type for block in message.content] == ["text"]
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens > 0


def test_sdk_streams_a_message_with_the_same_greedy_text(client, tiny_alias):
    """API-2: `messages.stream` reads our event sequence; text_stream and the final message agree."""
    # This SDK no longer types temperature; the alias's default (0) makes both runs greedy.
    kwargs = {"model": "tiny", "max_tokens": 12, "messages": HELLO}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    )


def test_sdk_raw_stream_events_come_in_anthropic_order(client, tiny_alias):
    events = list(client.messages.create(model="tiny", max_tokens=4, messages=HELLO, stream=True))
    names = [event.type for event in events]
    assert names[:2] == ["message_start", "content_block_start"]  # the SDK drops `ping`
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].usage.output_tokens == 4


def test_sdk_counts_tokens(client, tiny_alias):
    """API-2: `messages.count_tokens` equals the prompt a message feeds (input + cache reads)."""
    counted = client.messages.count_tokens(model="tiny", messages=HELLO, system="Be brief.")
    usage = client.messages.create(model="tiny", max_tokens=2, messages=HELLO, system="Be brief.").usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_sdk_raises_typed_errors(client, daphne_server, tiny_alias):
    """API-4: BadRequestError 400, AuthenticationError 401, NotFoundError 404 in Anthropic's envelope."""
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=0, messages=HELLO)
    assert bad.value.status_code == 400
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model="tiny", max_tokens=4, messages=HELLO, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(
            model="tiny",
            max_tokens=4,
            messages=HELLO,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "g"},
        )
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=HELLO)
    stranger = anthropic.Anthropic(base_url=daphne_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model="tiny", max_tokens=4, messages=HELLO)
    assert denied.value.status_code == 401


def test_sdk_raises_overloaded_error_for_a_full_lane(client, daphne_server, api_key, tiny_alias, tiny_eos_id):
    """LANE-2: a full lane is 529 overloaded_error, which the SDK raises as OverloadedError."""
    set_lane(daphne_server, api_key, tiny_alias, concurrency=1, queue_depth=0)
    body = endless(tiny_eos_id, messages=HELLO, max_tokens=100_000)
    with holding_stream(daphne_server, api_key, "/v1/chat/completions", body) as holder:
        assert holder.status_code == 200
        lines = holder.iter_lines()
        while not next(lines).startswith("data: "):
            pass  # the holder is generating: the one slot is taken and no queue is allowed
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            client.messages.create(model="tiny", max_tokens=4, messages=HELLO)
        assert overloaded.value.status_code == 529
        assert overloaded.value.body["error"]["type"] == "overloaded_error"
        assert int(overloaded.value.response.headers["Retry-After"]) >= 1
    wait_until(  # the holder hung up
        lambda: instance_snapshot(daphne_server, "tiny", api_key)["lane"]["active"] == 0,
        timeout=20,
        what="the holder's slot to be freed",
    )


def test_sdk_lists_and_retrieves_models(client, tiny_alias):
    """API-2, REG-8: `models.list()` and `models.retrieve()` parse our Anthropic-shaped answers."""
    [model] = list(client.models.list())
    assert isinstance(model, anthropic.types.ModelInfo)
    assert (model.id, model.type, model.display_name) == ("tiny", "model", "tiny")
    assert client.models.retrieve("tiny").created_at == model.created_at
