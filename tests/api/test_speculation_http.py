"""Speculation through Django with the tiny MLX model (docs/speculation.md): the alias setting,
OpenAI Predicted Outputs and their usage, /metrics and /readyz. Greedy text never changes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from django.test import AsyncClient

from tests.api.support import bearer, post_chat, save_alias, set_lane
from tests.api.test_metrics import open_stream, scrape
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# A copy-heavy prompt: prompt lookup has something to find, and the answer repeats itself.
COPY = [{"role": "user", "content": "one two three four one two three four one two three four"}]


async def chat(api_key: str, **fields) -> dict:
    response = await post_chat(api_key, **{"messages": COPY, **fields})
    assert response.status_code == 200, response.content
    return response.json()


def answer(body: dict) -> tuple[str, int]:
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def prediction_counts(body: dict) -> tuple[int, int]:
    details = body["usage"]["completion_tokens_details"]
    return details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]


@pytest.fixture
async def batched(tiny_alias, mlx_engine, tiny_eos_id):
    """The tiny alias on a batching lane (speculation is the batched scheduler's), EOS banned
    so every answer runs to max_tokens."""
    await set_lane(tiny_alias, concurrency=4)
    return {"logit_bias": {str(tiny_eos_id): -100}}


@pytest.mark.parametrize(
    "penalties",
    [
        pytest.param({}, id="plain"),
        pytest.param({"repetition_penalty": 1.3}, id="repetition"),
        pytest.param({"presence_penalty": 0.8, "frequency_penalty": 0.4}, id="presence-frequency"),
    ],
)
async def test_greedy_text_is_the_same_with_the_alias_setting_on_and_off(
    tiny_alias, api_key, batched, mlx_engine, penalties
):
    on = await chat(api_key, max_tokens=40, cache_salt="on", **penalties, **batched)
    drafted = mlx_engine.snapshot()[0]["speculation"]["drafted"]
    await save_alias(tiny_alias, speculation=False)
    off = await chat(api_key, max_tokens=40, cache_salt="off", **penalties, **batched)
    assert answer(on) == answer(off)
    assert prediction_counts(on) == prediction_counts(off) == (0, 0)
    assert mlx_engine.snapshot()[0]["speculation"]["drafted"] == drafted  # off drafted nothing
    await save_alias(tiny_alias, speculation=True, speculation_max_k=2)
    capped = await chat(api_key, max_tokens=40, cache_salt="capped", **penalties, **batched)
    assert answer(capped) == answer(off)


async def test_a_right_prediction_is_accepted_and_gives_the_same_text(api_key, batched, mlx_engine):
    plain = await chat(api_key, max_tokens=40, cache_salt="plain", **batched)
    text, tokens = answer(plain)
    right = await chat(
        api_key, max_tokens=40, cache_salt="right", prediction={"type": "content", "content": text}, **batched
    )
    assert answer(right) == (text, tokens)
    accepted, rejected = prediction_counts(right)
    # OpenAI's meaning: the answer is the prediction, so every one of its tokens appeared in it
    # (drafts from prompt lookup or left over at the end are no part of these counts).
    assert (accepted, rejected) == (tokens, 0), (accepted, rejected, tokens)

    (snap,) = mlx_engine.snapshot()
    assert snap["speculation"]["accepted"] >= accepted
    metrics = await scrape(**bearer(api_key))
    instance = {"instance": str(snap["instance_id"])}
    assert (
        metrics.get("mlxhost_speculation_accepted_tokens_total", **instance)
        == snap["speculation"]["accepted"]
    )
    assert (
        metrics.get("mlxhost_speculation_drafted_tokens_total", **instance) == snap["speculation"]["drafted"]
    )
    assert metrics.get("mlxhost_speculation_passes_total", **instance) == snap["speculation"]["passes"]
    ready = (await AsyncClient().get("/readyz", headers=bearer(api_key))).json()
    (model,) = ready["models"]
    assert model["speculation"]["accepted"] == snap["speculation"]["accepted"]
    assert 0 < model["speculation"]["acceptance"] <= 1


async def test_a_wrong_prediction_gives_the_same_text_as_none(api_key, batched):
    plain = await chat(api_key, max_tokens=30, cache_salt="plain", **batched)
    text, _ = answer(plain)
    wrong = await chat(
        api_key,
        max_tokens=30,
        cache_salt="wrong",
        prediction={
            "type": "content",
            "content": [{"type": "text", "text": text[:3] + " zebra quantum" * 9}],
        },
        **batched,
    )
    assert answer(wrong) == answer(plain)
    accepted, rejected = prediction_counts(wrong)
    # Only the prediction's first three characters are the answer's: the zebras never appear
    # (each " zebra quantum" is several tokens, all rejected).
    assert accepted <= 3 and rejected > 9 * 4, (accepted, rejected)


async def test_max_tokens_is_never_passed_with_a_right_prediction(api_key, batched):
    full, _ = answer(await chat(api_key, max_tokens=40, cache_salt="full", **batched))
    for limit in (1, 2, 7):
        body = await chat(
            api_key,
            max_tokens=limit,
            cache_salt=f"cut-{limit}",
            prediction={"type": "content", "content": full},
            **batched,
        )
        text, tokens = answer(body)
        assert tokens == limit
        assert full.startswith(text)
        assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "prediction",
    [
        pytest.param("text", id="a-string"),
        pytest.param({"type": "text", "content": "x"}, id="wrong-type"),
        pytest.param({"type": "content"}, id="no-content"),
        pytest.param({"type": "content", "content": 3}, id="content-a-number"),
        pytest.param({"type": "content", "content": [{"type": "image", "text": "x"}]}, id="a-non-text-part"),
        pytest.param({"type": "content", "content": "x", "extra": 1}, id="an-unknown-key"),
    ],
)
async def test_a_prediction_of_another_shape_is_a_400_naming_it(tiny_alias, api_key, prediction):
    response = await post_chat(api_key, prediction=prediction)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "prediction"
    assert error["type"] == "invalid_request_error"


async def test_usage_details_are_there_without_a_prediction_on_the_exclusive_path(
    tiny_alias, api_key, mlx_engine
):
    body = await chat(api_key, max_tokens=4, prediction={"type": "content", "content": "anything"})
    assert prediction_counts(body) == (0, 0)  # concurrency 1 runs alone: nothing drafts
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


async def test_a_cancel_mid_run_frees_the_slot_while_rows_draft(api_key, batched, mlx_engine):
    """LANE-6 with speculation on: a stream that drafts (a long right prediction of "\n"s, which
    the tiny model answers) is cut by its client; its slot comes back and the batch goes on."""
    prediction = {"type": "content", "content": "\n" * 2000}
    reader, frames = await open_stream(
        api_key, max_tokens=100_000, cache_salt="cut", prediction=prediction, **batched
    )
    await eventually(lambda: len(frames) >= 10, timeout=30, what="ten frames of the stream")
    reader.cancel()  # what a client disconnect does
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")
    (snap,) = mlx_engine.snapshot()
    assert snap["requests_cancelled"] == 1
    assert snap["speculation"]["accepted"] > 0  # it drafted before it was cut
    after = await chat(api_key, max_tokens=8, cache_salt="after", **batched)
    assert answer(after)[1] == 8


async def test_a_prediction_with_tools_is_a_400_saying_why(tiny_alias, api_key):
    """As OpenAI: a prediction is the answer's text, and a turn with tools may call them instead."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    response = await post_chat(api_key, prediction={"type": "content", "content": "x"}, tools=tools)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "prediction"
    assert "tools" in error["message"]


async def test_n_above_one_with_a_prediction_is_a_400_naming_n(tiny_alias, api_key):
    """Several choices and a prediction do not combine here (docs/api.md): one choice then."""
    response = await post_chat(api_key, n=2, prediction={"type": "content", "content": "x"})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "n"
    assert "prediction" in error["message"], error


async def test_a_draft_model_gives_the_same_text_through_the_api(
    tiny_alias, api_key, batched, mlx_engine, tiny_model_b_dir, monkeypatch
):
    """The tiny model with its seed-1 twin as draft model (admin field, issue 27): the alias's
    answer is the same with speculation on and off, and the draft's drafts are counted. The two
    are the same size, so the planner would rightly never draft: here every pass drafts."""
    from asgiref.sync import sync_to_async

    from mlxhost.engine.backends.mlx import backend as mlx_backend
    from mlxhost.engine.backends.mlx.draft_model import DraftCost
    from tests.engine.mlx.test_speculation import FLAT
    from tests.support import register_alias

    monkeypatch.setattr(mlx_backend, "SpeculationConfig", lambda: FLAT)
    monkeypatch.setattr(mlx_backend, "DraftCost", lambda share: DraftCost(0.0, measured=False))
    other = await sync_to_async(register_alias)(name="tiny-b", folder="tiny-llama-b")
    await set_lane(tiny_alias, draft_model=other.model)
    text = [{"role": "user", "content": "the baker opened the shop and the baker opened the shop and"}]
    on = await chat(api_key, messages=text, max_tokens=30, cache_salt="on", **batched)
    await save_alias(tiny_alias, speculation=False)
    off = await chat(api_key, messages=text, max_tokens=30, cache_salt="off", **batched)
    assert answer(on) == answer(off)
    instance = mlx_engine.get(mlx_engine.resolve("tiny"))
    assert instance.spec.draft is not None and instance.spec.draft.source.endswith("tiny-llama-b")
    assert instance.stats.speculation.drafted > 0
