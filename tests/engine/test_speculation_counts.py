"""Speculation through the engine on the fake backend: exact usage and snapshot counts
(docs/speculation.md). The fake drafts only from a prediction: each drafted token is accepted
while the prediction's text equals the script's next piece. A prediction's ids are its
characters: its usage counts (OpenAI's meaning) are the characters the text reproduced from the
prediction's start, and the rest of them."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from mlxhost.engine import Delta, Done, LaneSettings, ModelSpec
from tests.engine.conftest import collect, lane_idle, request, spec

PIECES = ["Hel", "lo, ", "wor", "ld", "!"]


def batching(capacity: int = 4) -> ModelSpec:
    return spec(1, lane=LaneSettings(capacity=capacity))


def predicted(request_id: str, prediction: str | None, *, max_draft: int = 8, **sampling):
    return replace(
        request(request_id, spec_=batching(), **sampling), prediction=prediction, max_draft=max_draft
    )


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def speculation_of(engine) -> dict:
    (snap,) = engine.snapshot()
    counts = dict(snap["speculation"])
    drafted, accepted, passes, emitted = (counts[k] for k in ("drafted", "accepted", "passes", "emitted"))
    assert counts.pop("acceptance") == (round(accepted / drafted, 4) if drafted else None)
    assert counts.pop("tokens_per_pass") == (round(emitted / passes, 3) if passes else None)
    return counts


async def run(engine, backend, req, pieces=PIECES):
    backend.enqueue(list(pieces))
    events = await collect(await engine.submit(req))
    done = events[-1]
    assert isinstance(done, Done), events
    await lane_idle(engine)
    return text_of(events), done


async def test_a_right_prediction_is_accepted_token_for_token_in_fewer_steps(engine, backend):
    text, done = await run(engine, backend, predicted("r1", "Hello, world!", max_tokens=32))
    assert text == "Hello, world!"
    usage = done.usage
    # The first piece is the model's own; the other four were drafted and accepted in one step.
    # The answer is the whole prediction: all 13 of its tokens accepted, none rejected.
    assert (usage.completion_tokens, usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == (
        5,
        13,
        0,
    )
    assert backend.batch_steps == [1, 1]  # one step for five tokens, then the end of the script
    assert speculation_of(engine) == {"drafted": 4, "accepted": 4, "passes": 1, "emitted": 5}
    # The turn's own figures (the chat page's "Drafts"): the same counts, this row's alone.
    assert (done.timings.drafted_tokens, done.timings.accepted_tokens, done.timings.tokens_per_pass) == (
        4,
        4,
        5.0,
    )
    assert done.timings.as_body()["tokens_per_pass"] == 5.0


async def test_a_wrong_prediction_gives_the_same_text_and_counts_what_it_missed(engine, backend):
    text, done = await run(engine, backend, predicted("r1", "Hello, there, again", max_tokens=32))
    assert text == "Hello, world!"
    usage = done.usage
    # Step 1: "Hel" is the model's, "lo, " accepted, "the" rejected against "wor", then "re" and
    # "," drafted against "ld" and "!" (cut to the script's piece widths): 4 drafted, 1 accepted.
    # The text then leaves the prediction, so no later step drafts. The answer reproduced the
    # prediction's "Hello, " (7 of its 19 tokens): that is the usage, not the drafts.
    assert (usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == (7, 12)
    assert usage.completion_tokens == 5
    assert speculation_of(engine) == {"drafted": 4, "accepted": 1, "passes": 4, "emitted": 5}
    assert (done.timings.drafted_tokens, done.timings.accepted_tokens, done.timings.tokens_per_pass) == (
        4,
        1,
        1.25,
    )


async def test_without_a_prediction_the_usage_details_are_zero_and_nothing_drafts(engine, backend):
    text, done = await run(engine, backend, predicted("r1", None, max_tokens=32))
    assert text == "Hello, world!"
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (0, 0)
    assert speculation_of(engine) == {"drafted": 0, "accepted": 0, "passes": 5, "emitted": 5}
    assert backend.predictions == [()]


async def test_an_alias_with_speculation_off_never_drafts_even_with_a_prediction(engine, backend):
    text, done = await run(engine, backend, predicted("r1", "Hello, world!", max_draft=0, max_tokens=32))
    assert text == "Hello, world!"
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (0, 0)
    assert speculation_of(engine) == {"drafted": 0, "accepted": 0, "passes": 0, "emitted": 0}
    assert backend.predictions == [()]  # not even tokenized
    # A turn that could not draft has no speculation figures at all, not zeros.
    assert done.timings.tokens_per_pass == 0.0
    assert set(done.timings.as_body()) == {"queue_ms", "ttft_ms", "prefill_tps", "decode_tps"}
    assert backend.batch_steps == [1] * 6


async def test_the_alias_cap_bounds_the_drafts_of_one_step(engine, backend):
    text, done = await run(engine, backend, predicted("r1", "Hello, world!", max_draft=2, max_tokens=32))
    assert text == "Hello, world!"
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (13, 0)
    assert backend.batch_steps == [1, 1, 1]  # 3 tokens, then 2, then the script's end
    assert speculation_of(engine)["passes"] == 2


async def test_max_tokens_is_never_passed_inside_an_accepted_run(engine, backend):
    req = predicted("r1", "Hello", max_tokens=3)
    text, done = await run(engine, backend, req, pieces=list("Hello"))
    assert text == "Hel"
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 3
    # Room for 2 drafts after the model's own first token: both accepted, none past the limit.
    # The answer reproduced "Hel" of the prediction; "lo" never appeared.
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (3, 2)


async def test_a_stop_string_inside_an_accepted_run_ends_the_answer_there(engine, backend):
    req = predicted("r1", "Hello, world!", max_tokens=32, stop=("wor",))
    text, done = await run(engine, backend, req)
    assert text == "Hello, "
    assert done.finish_reason == "stop"
    assert done.stop_sequence == "wor"
    # The whole run was accepted in the step; the answer counts what it shows up to the stop.
    # The prediction's counts follow the generated text, the stop string's part included.
    assert done.usage.completion_tokens == 3
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (13, 0)


async def test_the_engine_setting_off_turns_speculation_off_for_every_alias(make_engine, backend):
    engine = make_engine(speculation=False)
    text, done = await run(engine, backend, predicted("r1", "Hello, world!", max_tokens=32))
    assert text == "Hello, world!"
    assert done.usage.accepted_prediction_tokens == 0
    assert not backend.batches[0].speculation
    assert speculation_of(engine)["passes"] == 0


async def test_rows_with_and_without_predictions_count_apart_in_one_batch(engine, backend):
    backend.gated = True
    for _ in range(2):
        backend.enqueue(list(PIECES))
    right = await engine.submit(predicted("r1", "Hello, world!", max_tokens=32))
    plain = await engine.submit(predicted("r2", None, max_tokens=32))
    backend.gated = False
    backend.gate.set()
    events = await asyncio.gather(collect(right), collect(plain))
    assert [text_of(e) for e in events] == ["Hello, world!"] * 2
    dones = [e[-1] for e in events]
    assert [d.usage.accepted_prediction_tokens for d in dones] == [13, 0]
    # Each turn's figures are its own row's, not the batch's.
    figures = [
        (d.timings.drafted_tokens, d.timings.accepted_tokens, d.timings.tokens_per_pass) for d in dones
    ]
    assert figures == [(4, 4, 5.0), (0, 0, 1.0)]
    await lane_idle(engine)
    assert speculation_of(engine)["accepted"] == 4
    assert speculation_of(engine)["emitted"] == 10


async def test_a_grammar_row_never_drafts_even_with_a_right_prediction(engine, backend):
    """docs/speculation.md: a grammar's matcher must never see drafts that may be rejected."""
    pieces = ['{"a"', ": 1}"]
    req = replace(predicted("r1", '{"a": 1}', max_tokens=32), json_format="")
    text, done = await run(engine, backend, req, pieces=pieces)
    assert text == '{"a": 1}'
    # Nothing drafted, yet the answer is the prediction: OpenAI's counts say so.
    assert (done.usage.accepted_prediction_tokens, done.usage.rejected_prediction_tokens) == (8, 0)
    assert speculation_of(engine) == {"drafted": 0, "accepted": 0, "passes": 0, "emitted": 0}
