"""End to end: a real daphne process, the official `openai` SDK, the tiny real MLX model."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.conftest import endless, holding_stream, instance_snapshot, set_lane
from tests.support import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def client(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def test_sdk_streams_a_chat_completion(client, tiny_alias, tiny_eos_id):
    stream = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        stream=True,
        max_tokens=10,
        stream_options={"include_usage": True},
        logit_bias={str(tiny_eos_id): -100},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens > 0


def test_sdk_non_streaming_matches_streaming_under_greedy(client, tiny_alias):
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert whole.choices[0].message.content == streamed
    assert whole.object == "chat.completion"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_sdk_prediction_is_accepted_and_reported_in_usage(
    client, daphne_server, api_key, tiny_alias, tiny_eos_id
):
    """OpenAI Predicted Outputs through the SDK's own `prediction=` (docs/speculation.md): the
    same greedy text, the prediction's tokens accepted, the counts in completion_tokens_details."""
    set_lane(daphne_server, api_key, tiny_alias, concurrency=4, queue_depth=4)  # the batch drafts
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": 24, "logit_bias": {str(tiny_eos_id): -100}}
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    predicted = client.chat.completions.create(prediction={"type": "content", "content": text}, **kwargs)
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    # OpenAI's meaning: every token of the (right) prediction appeared in the answer.
    assert predicted.usage.completion_tokens == 24
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (24, 0), details
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(prediction={"type": "text", "content": text}, **kwargs)
    assert bad.value.body["param"] == "prediction"


def test_sdk_lists_models(client, tiny_alias):
    """REG-8: the SDK's models.list() parses our /v1/models."""
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_sdk_raises_typed_errors(client, daphne_server, tiny_alias):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    anonymous = openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model="tiny", messages=HELLO)


def test_client_disconnect_mid_stream_stops_generation(daphne_server, api_key, tiny_alias, tiny_eos_id):
    """LANE-6: a client that hangs up mid-stream stops the worker; the slot is freed."""
    body = endless(tiny_eos_id, messages=HELLO, max_tokens=100_000)
    with holding_stream(daphne_server, api_key, "/v1/chat/completions", body) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 20:
                break
    # The connection is closed here. The worker must stop well short of max_tokens.

    def freed() -> dict | None:
        snap = instance_snapshot(daphne_server, "tiny", api_key)
        return snap if snap["lane"]["active"] == 0 else None

    snap = wait_until(freed, timeout=20, what="the slot to be freed")
    assert snap["requests_cancelled"] == 1
    produced = snap["tokens_generated"]
    time.sleep(0.5)  # the thing under test: nothing more is generated while we look away
    assert instance_snapshot(daphne_server, "tiny", api_key)["tokens_generated"] == produced
    assert produced < 100_000


def test_sdk_reads_two_choices_streamed_and_not(client, daphne_server, api_key, tiny_alias, tiny_eos_id):
    """`n=2` as the SDK sends it: two choices with their indices, the usage of both, and streamed
    chunks the SDK sorts by `index` (docs/api.md)."""
    set_lane(daphne_server, api_key, tiny_alias, concurrency=2, queue_depth=2)  # rows of one batch
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "logit_bias": {str(tiny_eos_id): -100}}
    whole = client.chat.completions.create(n=2, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content  # the alias is greedy
    assert whole.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: whole.choices[0].message.content, 1: whole.choices[1].message.content}
    assert chunks[-1].usage.completion_tokens == 12
