"""The official `openai` SDK against a real daphne process: Responses create/retrieve/delete and chains."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import endless, holding_stream, set_lane

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def client(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0)


def test_create_retrieve_and_delete_through_the_sdk(client, tiny_alias):
    """API-1, PER-1: the SDK parses our response objects, with and without streaming."""
    created = client.responses.create(model="tiny", input="hello there", max_output_tokens=6)
    assert created.id.startswith("resp_")
    assert created.status == "incomplete"
    assert created.usage.output_tokens == 6
    assert created.output_text

    events = list(
        client.responses.create(model="tiny", input="hello there", max_output_tokens=6, stream=True)
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, as OpenAI reports it
    final = events[-1].response
    assert "".join(deltas) == final.output_text == created.output_text  # greedy: same text

    fetched = client.responses.retrieve(created.id)
    assert fetched.output_text == created.output_text
    assert fetched.usage.input_tokens == created.usage.input_tokens
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_a_three_turn_chain_through_the_sdk(client, tiny_alias):
    """API-1, SES-2: previous_response_id chains three turns; instructions carry over."""
    first = client.responses.create(model="tiny", input="hi", instructions="Be terse.", max_output_tokens=4)
    second = client.responses.create(
        model="tiny", input="more", previous_response_id=first.id, max_output_tokens=4
    )
    third = client.responses.create(
        model="tiny", input="again", previous_response_id=second.id, max_output_tokens=4
    )
    assert third.previous_response_id == second.id
    assert third.instructions == "Be terse."
    # Each turn sees the whole conversation so far.
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens


def test_typed_errors_through_the_sdk(client, tiny_alias, daphne_server):
    """API-4: 400, 401 and 404 arrive as the SDK's typed errors with our codes."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tiny", input="hi", max_output_tokens=0)
    assert bad.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="nope", input="hi")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_missing")
    stranger = openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key="mlxh_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model="tiny", input="hi")


def test_a_full_lane_is_a_rate_limit_error_through_the_sdk(
    client, tiny_alias, daphne_server, api_key, tiny_eos_id
):
    """LANE-2, API-4: over budget, the SDK raises RateLimitError with code queue_full and Retry-After."""
    set_lane(daphne_server, api_key, tiny_alias, concurrency=1, queue_depth=0)
    body = endless(tiny_eos_id, input="hold the slot", max_output_tokens=100_000)
    with holding_stream(daphne_server, api_key, "/v1/responses", body) as holder:
        lines = holder.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)  # the slot is taken
        with pytest.raises(openai.RateLimitError) as full:
            client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert full.value.body["code"] == "queue_full"
    assert int(full.value.response.headers["Retry-After"]) >= 1
