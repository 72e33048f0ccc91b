"""Draft-model speculation (issue 27 item 3), with tiny local models: exact on and off.

A draft with the target's own weights must accept every drafted token (the exactness harness);
a draft with other weights (the tiny model of seed 1, same tokenizer) accepts some and rejects
others. Either way the tokens, text, logprobs and caches equal the run without speculation, in
the batch (`MlxBatch` with `DraftModelRows`) and in the single stream (mlx-lm's
`speculative_generate_step` under `MlxModel.generate`). Draft forwards are priced at nothing here
(`FREE`), so that every pass drafts whatever the machine's speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from mlxhost.engine import ModelSpec, SamplingParams
from mlxhost.engine.backends.base import DraftCounts, StepEnd
from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.draft_model import DraftCost, DraftModelRows
from mlxhost.engine.errors import DraftMismatchError
from tests.engine.mlx.test_speculation import COPY, FLAT, assert_same, drive, greedy, mixed_requests

if TYPE_CHECKING:
    from mlxhost.engine.backends.mlx.drafting import SpeculationConfig

pytestmark = pytest.mark.timeout(300)


def load(folder, draft_folder=None) -> MlxModel:
    draft = ModelSpec(2, str(draft_folder), "d" * 64) if draft_folder is not None else None
    return MlxBackend().load(ModelSpec(1, str(folder), "f" * 64, draft=draft), lambda *_: None)


@pytest.fixture(scope="module")
def same(tiny_model_dir) -> MlxModel:
    """The tiny model drafting for itself: every draft must be accepted."""
    return load(tiny_model_dir, tiny_model_dir)


@pytest.fixture(scope="module")
def other(tiny_model_dir, tiny_model_b_dir) -> MlxModel:
    """The tiny model with the seed-1 tiny model as its draft (same tokenizer, other weights)."""
    return load(tiny_model_dir, tiny_model_b_dir)


def open_batch(model: MlxModel, capacity: int, speculation: SpeculationConfig | None, draft: bool = True):
    rows = DraftModelRows(model.draft, DraftCost(0.0, measured=False)) if draft and speculation else None
    return MlxBatch(
        model._model,
        model._tokenizer,
        capacity,
        vocabulary=model.vocabulary,
        speculation=speculation,
        draft=rows,
    )


@pytest.mark.parametrize("rows", [1, 4])
def test_a_draft_equal_to_the_target_accepts_every_drafted_token(same, tiny_eos_id, rows):
    """With penalties and logit bias too: the draft applies the row's processors."""
    requests = mixed_requests(same, ((tiny_eos_id, -100.0),))
    if rows == 1:
        off = [drive(open_batch(same, 1, None), [r])[0][0] for r in requests]
        ran = [drive(open_batch(same, 1, FLAT), [r]) for r in requests]
        on, stats = [r[0][0] for r in ran], [r[1][0] for r in ran]
    else:
        off, _ = drive(open_batch(same, 4, None), requests)
        on, by_row = drive(open_batch(same, 4, FLAT), requests)
        stats = [by_row[i] for i in range(4)]
    assert_same(same, requests, off, on)
    for s in stats:
        assert s.drafted > 0 and s.accepted == s.drafted, stats
        assert s.tokens_per_pass > 4, stats


def test_greedy_is_the_same_with_a_draft_that_errs(other, tiny_eos_id):
    """Another model's drafts: accepted in places, rejected in others; each row's target and
    draft caches trimmed to its own run, the output unchanged."""
    requests = mixed_requests(other, ((tiny_eos_id, -100.0),))
    off, _ = drive(open_batch(other, 4, None), requests)
    on, stats = drive(open_batch(other, 4, FLAT), requests)
    assert_same(other, requests, off, on)
    assert sum(s.accepted for s in stats.values()) > 0, stats
    assert sum(s.drafted - s.accepted for s in stats.values()) > 0, stats


def test_from_a_cached_prefix(other, same, tiny_eos_id):
    """A row starting from a cached target prefix: its draft cache is prefilled on the whole
    prompt at admission, and the tokens are the same."""
    prompt = same.encode(COPY * 2)
    sampling = greedy(40, logit_bias=((tiny_eos_id, -100.0),), repetition_penalty=1.1)
    entry = same.new_cache()
    list(same.generate(prompt, greedy(1), entry))
    reuse = len(prompt) - 3
    for model in (same, other):
        runs = [
            drive(
                open_batch(model, 2, config),
                [(prompt, sampling)],
                kvs=[(model.copy_cache(entry, reuse), reuse)],
            )
            for config in (None, FLAT)
        ]
        assert_same(model, [(prompt, sampling)], runs[0][0], runs[1][0])
    assert runs[1][1][0].accepted > 0


def test_seeded_sampling_is_the_same(other, tiny_eos_id):
    no_eos = ((tiny_eos_id, -100.0),)
    seeded = (
        other.encode(COPY * 2),
        SamplingParams(temperature=0.8, seed=99, max_tokens=40, logit_bias=no_eos),
    )
    company = (other.encode("a map " * 8), SamplingParams(temperature=0.9, max_tokens=20, logit_bias=no_eos))
    (off,), _ = drive(open_batch(other, 1, None), [seeded])
    on, stats = drive(open_batch(other, 2, FLAT), [seeded, company])
    assert on[0].ids == off.ids and on[0].text == off.text
    assert stats[0].drafted > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 8, 9, 10])
def test_max_tokens_is_never_passed(same, tiny_eos_id, max_tokens):
    request = (same.encode(COPY), greedy(max_tokens, logit_bias=((tiny_eos_id, -100.0),)))
    (off,), _ = drive(open_batch(same, 1, None), [request])
    (on,), _ = drive(open_batch(same, 1, FLAT), [request])
    assert on.ids == off.ids and len(on.ids) == max_tokens and on.finish == "length"
    assert len(on.cache_tokens) == len(request[0]) + max_tokens


def test_a_prediction_comes_before_the_draft_model(other, tiny_eos_id):
    """A right prediction drafts (all accepted, many tokens a pass) where the erring draft
    model would not."""
    request = (other.encode("Where does the river go?"), greedy(40, logit_bias=((tiny_eos_id, -100.0),)))
    (off,), _ = drive(open_batch(other, 1, None), [request])
    (on,), stats = drive(open_batch(other, 1, FLAT), [request], predictions=[off.ids])
    assert on.ids == off.ids
    assert stats[0].accepted == stats[0].drafted > 0 and stats[0].tokens_per_pass >= 4, stats[0]


def test_rows_joining_and_leaving_keep_each_draft_row_exact(same, tiny_eos_id):
    """Rows join a drafting batch while it decodes and others end: a draft equal to the target
    still accepts every token, so each row's draft cache held exactly its own tokens."""
    no_eos = ((tiny_eos_id, -100.0),)
    requests = [
        (same.encode(COPY), greedy(12, logit_bias=no_eos)),
        (same.encode("Where does the river go?"), greedy(40, logit_bias=no_eos)),
        (same.encode("a map of the valley " * 3), greedy(30, logit_bias=no_eos)),
        (same.encode("snow covered the roofs"), greedy(20, logit_bias=no_eos)),
    ]
    off = [drive(open_batch(same, 1, None), [r])[0][0].ids for r in requests]
    batch = open_batch(same, 4, FLAT)
    handles = [batch.insert(*requests[0], None, 0), batch.insert(*requests[1], None, 0)]
    got: dict[int, list[int]] = {}
    stats: dict[int, Any] = {}
    steps = 0
    while len(stats) < len(requests):
        for step in batch.step():
            got.setdefault(step.handle, [])
            if step.token_id is not None:
                got[step.handle].append(step.token_id)
            if step.finish_reason is not None:
                stats[step.handle] = batch.speculation_stats(step.handle)
        steps += 1
        if steps in (2, 4):  # one joins the batch at a time, mid-run
            handles.append(batch.insert(*requests[len(handles)], None, 0))
    batch.close()
    assert [got[h] for h in handles] == off
    for h in handles:
        assert stats[h].drafted > 0 and stats[h].accepted == stats[h].drafted, stats


def test_a_draft_with_another_vocabulary_is_a_load_error(tiny_model_dir, tiny_tools_model_dir):
    with pytest.raises(DraftMismatchError, match="a draft must use the same tokenizer"):
        load(tiny_model_dir, tiny_tools_model_dir)


# The single stream: mlx-lm's speculative_generate_step ----------------------------------------


def single(model: MlxModel, prompt: list[int], sampling: SamplingParams, max_draft: int, reuse: int = 0):
    """One stream through `MlxModel.generate`: its ids, text, finish and speculation counts."""
    kv = model.new_cache()
    if reuse:
        list(model.generate(prompt[:reuse], greedy(1), kv))
        model.trim_cache(kv, model.cache_length(kv) - reuse)
    ids, text, finish, counts = [], "", None, DraftCounts()
    steps = model.generate(
        prompt[reuse:], sampling, kv, context=prompt[:reuse], max_draft=max_draft, counts=counts
    )
    for step in steps:
        text += step.text
        if isinstance(step, StepEnd):
            finish = step.finish_reason
        else:
            ids.append(step.token_id)
    return (ids, text, finish), counts


@pytest.mark.parametrize(
    "sampling",
    [
        greedy(40, repetition_penalty=1.3),
        greedy(30, frequency_penalty=0.5, presence_penalty=0.3),
        greedy(3),
    ],
    ids=["repetition", "frequency-presence", "three-tokens"],
)
def test_the_single_stream_is_the_same_with_a_draft(other, same, sampling):
    """mlx-lm's speculative_generate_step with the row's penalties over the whole prompt (it
    shows them only the prompt's last token: the rest is their context here), cold and from a
    cached prefix; the counts add up, and the target's own weights as draft accept everything."""
    prompt = other.encode(COPY * 2)
    plain, none = single(other, prompt, sampling, 0)
    assert none == DraftCounts() and len(plain[0]) == sampling.max_tokens
    for model in (other, same):
        got, counts = single(model, prompt, sampling, 8)
        assert got == plain
        assert counts.emitted == len(plain[0]) and 0 < counts.passes < counts.emitted, counts
        assert single(model, prompt, sampling, 8, reuse=len(prompt) - 5)[0] == plain  # a cached prefix
    assert counts.accepted == counts.drafted > 0, counts  # the last model: the target's own weights


def test_a_seeded_single_stream_runs_without_its_draft(other):
    """mlx-lm samples a verify pass's positions in one call, which would consume a seeded key
    otherwise than token by token: a seeded sampled stream runs plain, the same text."""
    prompt = other.encode(COPY * 2)
    sampling = SamplingParams(temperature=0.9, seed=7, max_tokens=30)
    plain, _ = single(other, prompt, sampling, 0)
    got, counts = single(other, prompt, sampling, 8)
    assert got == plain and counts.passes == 0


def test_the_draft_cost_is_measured_and_drifts_back_to_its_seed():
    """A draft forward costs its seed (a share of the target's plain step) until measured; a
    dear measurement fades back towards the seed over plain steps, so drafting is tried again;
    a pass of width w pays w - 1 draft forwards on top of the verify pass."""
    cost = DraftCost(0.25)
    assert cost(2, 80.0) == 20.0
    cost.record(2, 4, 0.4)  # four forwards in 400 ms: 100 ms each
    assert cost(2, 80.0) == pytest.approx(100.0)
    for _ in range(70):
        cost.drift()
    assert 20.0 < cost(2, 80.0) < 60.0
    priced = DraftCost(0.5, measured=False).priced(lambda width, rows: 10.0 * width)
    assert priced(1, 2) == 10.0 and priced(4, 2) == 40.0 + 3 * 5.0
