"""API-1: `n` > 1 on chat and text completions through Django with the tiny real MLX model: the choices
as rows of one batch, their indices, usage, seeds, slots and cancel (docs/api.md)."""

from __future__ import annotations

import pytest

from tests.api.support import StreamReader, bearer, post_chat, post_json, set_lane, sse_payloads
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def no_eos(tiny_eos_id) -> dict[str, int]:
    return {str(tiny_eos_id): -100}


@pytest.fixture
async def batched(tiny_alias):
    """The tiny model on a lane of 4 slots and no queue: the batched scheduler."""
    await set_lane(tiny_alias, concurrency=4, queue_depth=0)
    return tiny_alias


def texts(body: dict) -> list[str]:
    return [choice["message"]["content"] for choice in body["choices"]]


def lane(engine) -> dict:
    return engine.snapshot()[0]["lane"]


async def test_greedy_choices_are_equal_and_usage_counts_the_prompt_once(
    batched, api_key, mlx_engine, no_eos, monkeypatch
):
    one = (await post_chat(api_key, max_tokens=6, logit_bias=no_eos, cache_salt="elsewhere")).json()
    (instance,) = mlx_engine.registry.instances()
    prefilled, prefill = [], instance.model.prefill

    def counted(kv, token_ids, adapter=None):
        prefilled.append(len(token_ids))
        return prefill(kv, token_ids, adapter)

    monkeypatch.setattr(instance.model, "prefill", counted)
    response = await post_chat(api_key, n=3, max_tokens=6, logit_bias=no_eos)
    assert response.status_code == 200, response.content
    body = response.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert [choice["finish_reason"] for choice in body["choices"]] == ["length"] * 3
    assert texts(body) == texts(one) * 3
    usage = body["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 18
    assert usage["total_tokens"] == usage["prompt_tokens"] + 18
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # the first row computed it
    assert prefilled == [usage["prompt_tokens"] - 1]  # once, for the three rows
    await eventually(lambda: lane(mlx_engine)["active"] == 0, what="every row's slot back")


async def test_seeded_choices_are_reproducible_and_each_has_its_own_seed(
    batched, api_key, mlx_engine, no_eos
):
    sampled = {"n": 2, "temperature": 1.0, "seed": 1234, "max_tokens": 12, "logit_bias": no_eos}
    first = texts((await post_chat(api_key, **sampled)).json())
    again = texts((await post_chat(api_key, **sampled)).json())
    assert first == again
    assert first[0] != first[1], first  # seed 1234 and 1235 (docs/api.md): two draws
    other = texts((await post_chat(api_key, **{**sampled, "seed": 99})).json())
    assert other != first
    # Choice i samples with seed + i: the second choice is what one choice with seed 1235 gives.
    alone = texts((await post_chat(api_key, **{**sampled, "n": 1, "seed": 1235})).json())
    assert alone == first[1:]


async def test_streamed_choices_carry_their_index_and_one_usage(batched, api_key, mlx_engine, no_eos):
    body = {"n": 2, "max_tokens": 5, "logit_bias": no_eos}
    whole = texts((await post_chat(api_key, **body)).json())
    response = await post_chat(api_key, stream=True, stream_options={"include_usage": True}, **body)
    assert response.status_code == 200
    payloads = await sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [p for p in payloads[:-1] if p["choices"]]
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for index, parts in by_index.items():
        assert parts[0]["delta"] == {"role": "assistant", "content": ""}
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["length"]
        assert "".join(p["delta"].get("content") or "" for p in parts) == whole[index]
    [usage_chunk] = [p for p in payloads[:-1] if not p["choices"]]
    assert usage_chunk["usage"]["completion_tokens"] == 10
    assert payloads[-2] is usage_chunk


async def test_logprobs_come_with_every_choice(batched, api_key, mlx_engine, no_eos):
    body = (
        await post_chat(api_key, n=2, max_tokens=3, logprobs=True, top_logprobs=2, logit_bias=no_eos)
    ).json()
    for choice in body["choices"]:
        assert len(choice["logprobs"]["content"]) == 3
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])


async def test_text_completions_take_n_streamed_and_not(batched, api_key, mlx_engine, no_eos):
    body = {"model": "tiny", "prompt": "Once upon a time", "n": 2, "max_tokens": 4, "logit_bias": no_eos}
    whole = (await post_json("/v1/completions", body, bearer(api_key))).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["choices"][0]["text"] == whole["choices"][1]["text"]  # the alias is greedy
    assert whole["usage"]["completion_tokens"] == 8
    streamed = await post_json("/v1/completions", {**body, "stream": True}, bearer(api_key))
    payloads = await sse_payloads(streamed)
    for index in (0, 1):
        parts = [p["choices"][0] for p in payloads[:-1] if p["choices"][0]["index"] == index]
        assert "".join(p["text"] for p in parts) == whole["choices"][index]["text"]
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["length"]


async def test_choices_beyond_the_lane_are_refused_with_its_envelope_and_take_nothing(
    batched, api_key, mlx_engine, no_eos
):
    """LANE-2: each choice takes a slot: 5 choices on 4 slots and no queue are a 429 queue_full, and the
    four permits taken before the fifth was refused go back."""
    response = await post_chat(api_key, n=5, max_tokens=2, logit_bias=no_eos)
    assert response.status_code == 429, response.content
    assert response.json()["error"]["code"] == "queue_full"
    assert (lane(mlx_engine)["active"], lane(mlx_engine)["permits"]) == (0, 0)
    fits = await post_chat(api_key, n=4, max_tokens=2, logit_bias=no_eos)
    assert fits.status_code == 200
    assert len(fits.json()["choices"]) == 4


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools",
        ),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ],
)
async def test_n_with_tools_or_a_prediction_is_a_400_naming_n(tiny_alias, api_key, extra, field):
    response = await post_chat(api_key, n=2, **extra)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n"
    assert field in error["message"]


async def test_n_above_the_setting_is_a_400_naming_n(tiny_alias, api_key, settings):
    settings.MLXHOST_MAX_CHOICES = 2
    response = await post_chat(api_key, n=3)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert "at most 2" in response.json()["error"]["message"]


async def test_a_disconnect_cancels_every_choice(batched, api_key, mlx_engine, no_eos):
    reader = StreamReader(await post_chat(api_key, n=3, stream=True, max_tokens=100_000, logit_bias=no_eos))
    await reader.wait_for(6)
    assert lane(mlx_engine)["active"] == 3
    await reader.hang_up()
    await eventually(lambda: lane(mlx_engine)["active"] == 0, timeout=10, what="all three rows cancelled")
    assert mlx_engine.snapshot()[0]["requests_cancelled"] == 3


async def test_at_concurrency_one_the_choices_run_one_after_another(tiny_alias, api_key, mlx_engine, no_eos):
    """The exclusive scheduler: no batch, each row waits for the one slot; same greedy texts."""
    one = (await post_chat(api_key, max_tokens=4, logit_bias=no_eos, cache_salt="elsewhere")).json()
    body = (await post_chat(api_key, n=2, max_tokens=4, logit_bias=no_eos)).json()
    assert texts(body) == texts(one) * 2
    assert body["usage"]["completion_tokens"] == 8
    assert mlx_engine.snapshot()[0]["lane"]["capacity"] == 1
