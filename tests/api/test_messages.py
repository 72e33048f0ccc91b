"""POST /v1/messages and /v1/messages/count_tokens through Django with the tiny real MLX model."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from tests.api.support import ScriptedGeneration, StreamReader, post_chat, set_lane, sse_events
from tests.support import eventually, user_with_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

URL = "/v1/messages"
COUNT_URL = "/v1/messages/count_tokens"
HELLO = [{"role": "user", "content": "Hello there"}]
EVENT_ORDER = ["message_start", "content_block_start", "ping"]
CLOSING = ["content_block_stop", "message_delta", "message_stop"]


def anthropic_headers(key: str | None) -> dict[str, str]:
    return {"anthropic-version": "2023-06-01", **({"x-api-key": key} if key else {})}


async def post(body: dict, key: str | None, url: str = URL, **headers):
    return await AsyncClient().post(
        url,
        data=json.dumps(body),
        content_type="application/json",
        headers={**anthropic_headers(key), **headers},
    )


def message_body(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 8, "messages": HELLO, **fields}


async def make_key(django_user_model, username: str) -> str:
    return (await sync_to_async(user_with_key)(django_user_model, username))[1]


def prompt_tokens(usage: dict) -> int:
    """The whole prompt: Anthropic's `input_tokens` leave out what was read from the cache, and
    the same prompt sent twice may start from the first one's cache (SES-8)."""
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)


async def test_non_streaming_message_has_anthropic_shape(tiny_alias, api_key, mlx_engine):
    """API-2: a `message` object with text content, stop_reason and Anthropic usage."""
    response = await post(message_body(), api_key)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["id"].startswith("msg_")
    assert (body["type"], body["role"], body["model"]) == ("message", "assistant", "tiny")
    assert [block["type"] for block in body["content"]] == ["text"]
    assert isinstance(body["content"][0]["text"], str)
    assert body["stop_reason"] == "max_tokens"
    assert body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] == 8
    assert usage["cache_read_input_tokens"] == 0
    assert usage["cache_creation_input_tokens"] == 0
    assert response["X-Session-Cache"] == "fresh"
    assert response["request-id"] == body["id"]


async def test_streaming_follows_anthropic_event_sequence(tiny_alias, api_key, mlx_engine):
    """API-2: message_start, content_block_start, ping, deltas, content_block_stop, message_delta, message_stop."""
    whole = (await post(message_body(max_tokens=12), api_key)).json()
    response = await post(message_body(max_tokens=12, stream=True), api_key)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    events = await sse_events(response)
    names = [name for name, _ in events]
    assert names[:3] == EVENT_ORDER
    assert names[-3:] == CLOSING
    assert set(names[3:-3]) <= {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)

    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert prompt_tokens(start["usage"]) == prompt_tokens(whole["usage"])
    assert start["usage"]["output_tokens"] == 0
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole["content"][0]["text"]  # greedy
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == 12


async def test_system_prompt_and_text_blocks_are_rendered(tiny_alias, api_key, mlx_engine):
    """API-2: `system` as a string or text blocks, content as a string or text blocks."""
    plain = await post(message_body(system="Be brief.", max_tokens=4), api_key)
    blocks = await post(
        message_body(
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
            max_tokens=4,
        ),
        api_key,
    )
    bare = await post(message_body(max_tokens=4), api_key)
    assert prompt_tokens(plain.json()["usage"]) == prompt_tokens(blocks.json()["usage"])
    assert plain.json()["content"] == blocks.json()["content"]
    assert plain.json()["usage"]["input_tokens"] > bare.json()["usage"]["input_tokens"]


async def test_stop_sequence_cuts_the_text_and_ends_the_turn(tiny_alias, api_key, mlx_engine):
    """API-2: a stop sequence ends the turn; stop_reason and stop_sequence name the match."""
    full = (await post(message_body(max_tokens=20), api_key)).json()["content"][0]["text"]
    stop = full[2:4]
    never = "\u2603never"
    body = (await post(message_body(max_tokens=20, stop_sequences=[never, stop]), api_key)).json()
    assert body["content"][0]["text"] == full[: full.index(stop)]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop)
    assert body["usage"]["output_tokens"] < 20

    response = await post(message_body(max_tokens=20, stop_sequences=[stop], stream=True), api_key)
    events = await sse_events(response)
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


async def test_max_tokens_is_clamped_by_the_alias(tiny_alias, api_key, mlx_engine):
    """REG-1: max_output_tokens clamps the required max_tokens."""
    tiny_alias.max_output_tokens = tiny_alias.max_tokens = 5
    await tiny_alias.asave()
    body = (await post(message_body(max_tokens=500), api_key)).json()
    assert body["usage"]["output_tokens"] == 5
    assert body["stop_reason"] == "max_tokens"


async def test_a_follow_up_turn_reuses_the_warm_session_and_matches_a_cold_run(
    tiny_alias, api_key, mlx_engine, django_user_model
):
    """SES-2 tier 3, SES-7: the next turn hits any warm slot (same system prompt); SES-3: never another tenant's."""
    first = await post(message_body(system="Be brief.", max_tokens=20, stop_sequences=["\n\n"]), api_key)
    assert first.json()["stop_reason"] in {"end_turn", "stop_sequence"}  # clean: adopted (SES-1)
    reply = first.json()["content"][0]["text"]
    turn2 = [*HELLO, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    other_key = await make_key(django_user_model, "bob")

    warm = await post(message_body(system="Be brief.", messages=turn2, max_tokens=10), api_key)
    cold = await post(message_body(system="Be brief.", messages=turn2, max_tokens=10), other_key)

    assert warm["X-Session-Cache"] == "hit"
    usage = warm.json()["usage"]
    assert usage["cache_read_input_tokens"] > 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == cold.json()["usage"]["input_tokens"]
    assert cold["X-Session-Cache"] == "fresh"
    assert cold.json()["usage"]["cache_read_input_tokens"] == 0
    assert warm.json()["content"] == cold.json()["content"]


async def test_another_system_prompt_reuses_only_the_shared_token_prefix(
    tiny_alias, api_key, mlx_engine, django_user_model
):
    """SES-3: tier 3 needs a byte-equal system prompt; SES-8: only the common token prefix is reused."""
    first = await post(message_body(system="Be brief.", max_tokens=20, stop_sequences=["\n\n"]), api_key)
    other_key = await make_key(django_user_model, "bob")
    warm = await post(message_body(system="Be verbose.", max_tokens=6), api_key)
    cold = await post(message_body(system="Be verbose.", max_tokens=6), other_key)
    cached = warm.json()["usage"]["cache_read_input_tokens"]
    assert cached < first.json()["usage"]["input_tokens"]
    assert warm.json()["content"] == cold.json()["content"]


async def test_count_tokens_matches_the_prompt_a_message_feeds(tiny_alias, api_key, mlx_engine):
    """API-2: count_tokens is the templated prompt's length, system prompt included."""
    prompt = {"system": "Be brief.", "messages": HELLO}
    counted = await post({"model": "tiny", **prompt}, api_key, url=COUNT_URL)
    assert counted.status_code == 200
    assert set(counted.json()) == {"input_tokens"}
    usage = (await post(message_body(**prompt, max_tokens=2), api_key)).json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    bare = await post({"model": "tiny", "messages": HELLO}, api_key, url=COUNT_URL)
    assert bare.json()["input_tokens"] < counted.json()["input_tokens"]


async def test_a_full_lane_is_529_overloaded_but_count_tokens_still_answers(
    tiny_alias, api_key, mlx_engine, tiny_eos_id, caplog
):
    """LANE-2: over budget on the Anthropic surface is 529 overloaded_error with Retry-After; its
    reason phrase is "Overloaded", so the log never says "Unknown Status Code" (issue 25)."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    no_eos = {str(tiny_eos_id): -100}
    holder = StreamReader(await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await holder.wait_for(3)

    refused = await post(message_body(), api_key)
    assert refused.status_code == 529
    assert refused.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": refused.json()["error"]["message"]},
    }
    assert int(refused["Retry-After"]) >= 1
    assert refused.reason_phrase == "Overloaded"
    streaming = await post(message_body(stream=True), api_key)
    assert streaming.status_code == 529
    assert "Unknown Status" not in caplog.text and "Overloaded: /v1/messages" in caplog.text
    counted = await post({"model": "tiny", "messages": HELLO}, api_key, url=COUNT_URL)
    assert counted.status_code == 200  # a count is not a generation: no lane permit
    await holder.hang_up()


async def test_a_disconnect_mid_stream_frees_the_lane(tiny_alias, api_key, mlx_engine):
    """LANE-6: hanging up on a messages stream cancels the generation and frees the slot."""
    reader = StreamReader(await post(message_body(max_tokens=100_000, stream=True), api_key))
    await reader.wait_for(6)
    await reader.hang_up()
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")
    snap = mlx_engine.snapshot()[0]
    assert snap["lane"]["active"] == 0
    assert snap["requests_cancelled"] == 1
    assert snap["tokens_generated"] < 100_000
    after = await post(message_body(max_tokens=2), api_key)
    assert after.status_code == 200


async def test_missing_or_wrong_key_is_401_in_anthropic_envelope(tiny_alias, api_key):
    """API-5, API-4: x-api-key is required; the 401 uses Anthropic's envelope."""
    for key in (None, api_key[:-2] + "xx"):
        response = await post(message_body(), key)
        assert response.status_code == 401
        body = response.json()
        assert body["type"] == "error"
        assert body["error"]["type"] == "authentication_error"
        assert set(body["error"]) == {"type", "message"}
    assert (await post({"model": "tiny", "messages": HELLO}, None, url=COUNT_URL)).status_code == 401


async def test_bearer_auth_is_accepted_too(tiny_alias, api_key, mlx_engine):
    """API-5: Bearer works on the Anthropic surface as well."""
    response = await post(message_body(max_tokens=2), None, Authorization=f"Bearer {api_key}")
    assert response.status_code == 200


async def test_unknown_model_is_404_not_found_error(api_key):
    """API-4: an unknown alias is Anthropic's not_found_error."""
    for url, body in ((URL, message_body(model="nope")), (COUNT_URL, {"model": "nope", "messages": HELLO})):
        response = await post(body, api_key, url=url)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"
        assert "nope" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        pytest.param({"max_tokens": None}, "max_tokens", id="max-tokens-null"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"temperature": 1.5}, "temperature", id="temperature-above-one"),
        pytest.param({"top_p": -0.1}, "top_p", id="negative-top-p"),
        pytest.param({"messages": []}, "messages", id="no-messages"),
        pytest.param(
            {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", id="unknown-role"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source",
            id="image-block-without-source",
        ),
        pytest.param({"system": [{"type": "image"}]}, "system", id="system-image-block"),
        pytest.param({"stop_sequences": "END"}, "stop_sequences", id="stop-sequences-not-a-list"),
        pytest.param({"stream": "yes"}, "stream", id="stream-not-bool"),
        pytest.param({"metadata": "x"}, "metadata", id="metadata-not-an-object"),
        pytest.param({"tools": [{"name": "f"}]}, "tools", id="tool-without-schema"),
        pytest.param({"tools": [{"type": "mystery_tool", "name": "m"}]}, "tools", id="unknown-tool-type"),
        pytest.param({"tool_choice": {"type": "sometimes"}}, "tool_choice", id="tool-choice-type"),
        pytest.param(
            {"thinking": {"type": "enabled", "budget_tokens": 100}},
            "thinking.budget_tokens",
            id="thinking-budget-under-1024",
        ),
        pytest.param({"thinking": {"type": "sometimes"}}, "thinking.type", id="thinking-type"),
        pytest.param(
            {"output_config": {"format": {"type": "json_schema"}}},
            "output_config.format",
            id="structured-output-without-schema",
        ),
    ],
)
async def test_bad_input_is_400_invalid_request_error(tiny_alias, api_key, patch, param):
    """API-4 (Anthropic surface): bad or unsupported input is a 400 invalid_request_error naming the field."""
    body = {**message_body(), **patch}
    if patch.get("max_tokens", 1) is None:
        del body["max_tokens"]
    response = await post(body, api_key)
    assert response.status_code == 400, response.content
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{param}: ")


async def test_unsupported_content_says_so(tiny_alias, api_key):
    document = {"role": "user", "content": [{"type": "document", "source": {"type": "base64"}}]}
    response = await post(message_body(messages=[document]), api_key)
    assert "'document' are not supported" in response.json()["error"]["message"]


async def test_disabled_options_and_consecutive_turns_are_accepted(tiny_alias, api_key, mlx_engine):
    """API-2: disabled thinking/tools, metadata, effort and cache_control pass; same-role turns merge."""
    body = message_body(
        messages=[{"role": "user", "content": "Hello"}, {"role": "user", "content": "there"}],
        thinking={"type": "disabled"},
        tool_choice={"type": "none"},
        tools=[],
        metadata={"user_id": "u-1"},
        output_config={"effort": "low"},
        cache_control={"type": "ephemeral"},
        max_tokens=2,
    )
    response = await post(body, api_key)
    assert response.status_code == 200, response.content


async def test_count_tokens_rejects_unsupported_input(tiny_alias, api_key):
    response = await post(
        {"model": "tiny", "messages": HELLO, "tools": [{"name": "f"}]}, api_key, url=COUNT_URL
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_malformed_json_and_wrong_method_use_the_envelope(api_key):
    """API-4: every failure leaves in Anthropic's envelope."""
    client = AsyncClient()
    bad = await client.post(
        URL, data="{not json", content_type="application/json", headers=anthropic_headers(api_key)
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    wrong = await client.get(URL, headers=anthropic_headers(api_key))
    assert wrong.status_code == 405
    assert wrong.json()["type"] == "error"


async def test_prompt_over_max_input_tokens_is_400(tiny_alias, api_key, mlx_engine):
    """API-4: a too-long prompt is 400 invalid_request_error, never a 5xx."""
    tiny_alias.max_input_tokens = 5
    await tiny_alias.asave()
    response = await post(message_body(), api_key)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def decode(frames: list[bytes]) -> list[tuple[str, dict]]:
    events = []
    for frame in frames:
        head, data = frame.decode().strip().split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_a_mid_stream_failure_is_an_error_event():
    """API-4: a failure after the first byte is Anthropic's `error` event, then the stream ends."""
    from api.anthropic.messages import MessageTurn, message_sse
    from mlxhost.engine import Delta, Failed, Started

    generation = ScriptedGeneration(
        Started(prompt_tokens=7), Delta(text="Hi"), Failed(code="generation_failed", message="boom")
    )
    events = decode([frame async for frame in message_sse(MessageTurn("msg_x", "tiny"), generation)])
    assert [name for name, _ in events] == [*EVENT_ORDER, "content_block_delta", "error"]
    # API-4: the engine's detail stays in the log; the client gets a fixed text.
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "The model failed while generating."},
    }


async def test_a_request_cancelled_before_it_ran_opens_the_message_and_ends_with_an_error():
    """LANE-6: a cancelled answer still opens the message, then ends with an `error` event,
    never with `stop_reason: end_turn`, which would read like a complete answer."""
    from api.anthropic.messages import MessageTurn, message_sse
    from mlxhost.engine import Done, Timings, Usage

    done = Done(finish_reason="cancelled", usage=Usage(0, 0), timings=Timings(0, 0, 0, 0))
    frames = [frame async for frame in message_sse(MessageTurn("msg_x", "tiny"), ScriptedGeneration(done))]
    events = decode(frames)
    assert [name for name, _ in events] == ["message_start", "error"]  # no block was ever opened
    assert events[-1][1]["error"]["type"] == "api_error"


async def test_a_stream_aborted_by_a_drain_ends_with_overloaded_error_not_end_turn():
    """LANE-7, OPS-5: a stream the server cut short (drain timeout, shutdown) ends with an
    `overloaded_error` event; no `message_delta` claims `end_turn`."""
    from api.anthropic.messages import MessageTurn, message_sse
    from mlxhost.engine import Delta, Done, Started, Timings, Usage

    done = Done(finish_reason="aborted", usage=Usage(7, 1), timings=Timings(0, 0, 0, 0))
    generation = ScriptedGeneration(Started(prompt_tokens=7), Delta(text="Hi"), done)
    events = decode([frame async for frame in message_sse(MessageTurn("msg_x", "tiny"), generation)])
    assert [name for name, _ in events] == [*EVENT_ORDER, "content_block_delta", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error"
    assert not any(name == "message_delta" for name, _ in events)


async def test_a_failure_before_the_answer_is_a_500_api_error():
    from api.anthropic.messages import MessageTurn, message_complete
    from api.errors import ApiError, error_body
    from mlxhost.engine import Failed, Started

    generation = ScriptedGeneration(
        Started(prompt_tokens=7), Failed(code="generation_failed", message="boom")
    )
    with pytest.raises(ApiError) as failure:
        await message_complete(MessageTurn("msg_x", "tiny"), generation)
    assert failure.value.status == 500
    assert error_body(failure.value, "anthropic")["error"]["type"] == "api_error"
