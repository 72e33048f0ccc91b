"""Speculative decoding inside the MLX batch (issue 27): exact on and off, with the tiny model.

Every test runs the same requests through an `MlxBatch` without speculation and one with it, and
compares token ids, text, finish reasons and logprobs. A verify pass multiplies other matrix
shapes than a one-token step; where greedy output differs, the message shows the top-two logit
gap at the first differing position (a near-tie under 1e-4 is rounding, anything else a bug).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import pytest

from mlxhost.engine import ModelSpec, SamplingParams
from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.batch import MlxBatch, make_processors
from mlxhost.engine.backends.mlx.drafting import PassCost, SpeculationConfig
from mlxhost.engine.types import Grammar

pytestmark = pytest.mark.timeout(300)

# Drafting always pays under this cost table (a pass costs the same at any width), so the
# tests exercise wide passes and mixed acceptance on every step they can; not corrected by
# measured step times (which would stop the drafting that the tests exist to check).
FLAT = SpeculationConfig(cost=PassCost({1: {1: 1.0, 64: 1.0}}), measure=False)
COPY = "the baker opened the shop and the baker opened the shop and the baker opened the "


@dataclass
class Run:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    logprobs: list[float] = field(default_factory=list)
    cache_tokens: tuple[int, ...] = ()
    cache: Any = None


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> MlxModel:
    """The loaded tiny model (named for what it stands in for: the mlx backend's model)."""
    return MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)


def open_batch(backend: MlxModel, capacity: int, speculation: SpeculationConfig | None) -> MlxBatch:
    return MlxBatch(
        backend._model, backend._tokenizer, capacity, vocabulary=backend.vocabulary, speculation=speculation
    )


def drive(
    batch: MlxBatch,
    requests: list[tuple[list[int], SamplingParams]],
    predictions: list[list[int] | None] | None = None,
    kvs: list[tuple[Any, int]] | None = None,
) -> tuple[list[Run], dict[int, Any]]:
    """Insert every request at once, step until all end; each one's run and speculation counts."""
    handles = []
    for i, (prompt, sampling) in enumerate(requests):
        kv, cached = kvs[i] if kvs else (None, 0)
        prediction = predictions[i] if predictions else None
        handles.append(batch.insert(prompt, sampling, kv, cached, prediction_ids=prediction))
    runs = {h: Run() for h in handles}
    stats: dict[int, Any] = {}
    while any(r.finish is None for r in runs.values()):
        for step in batch.step():
            run = runs[step.handle]
            run.text += step.text
            if step.token_id is not None:
                run.ids.append(step.token_id)
            if step.logprob is not None:
                run.logprobs.append(step.logprob.logprob)
            if step.finish_reason is not None:
                run.finish = step.finish_reason
                assert step.cache is not None
                run.cache, run.cache_tokens = step.cache.kv, step.cache.tokens
                stats[step.handle] = batch.speculation_stats(step.handle)
    batch.close()
    return [runs[h] for h in handles], {i: stats.get(h) for i, h in enumerate(handles)}


def explain(backend: MlxModel, prompt: list[int], sampling: SamplingParams, off: Run, on: Run) -> str:
    """Where two greedy runs part, and the top-two logit gap of the model at that position."""
    common = next((i for i, (a, b) in enumerate(zip(off.ids, on.ids, strict=False)) if a != b), None)
    if common is None:
        return (
            f"same common tokens, lengths {len(off.ids)} / {len(on.ids)}, finish {off.finish} / {on.finish}"
        )
    model = backend._model
    context = [*prompt, *off.ids[:common]]
    logits = model(mx.array([context]))[:, -1, :]
    for processor in make_processors(sampling, backend.vocabulary):
        logits = processor(mx.array(context), logits)
    top = sorted(logits[0].tolist(), reverse=True)[:2]
    return (
        f"first difference at token {common}: off {off.ids[common]}, on {on.ids[common]}; "
        f"top-two logit gap {top[0] - top[1]:.3g} ({'near-tie' if top[0] - top[1] < 1e-4 else 'NOT a tie'})"
    )


def assert_same(backend, requests, off: list[Run], on: list[Run]) -> None:
    for (prompt, sampling), a, b in zip(requests, off, on, strict=True):
        assert a.ids == b.ids, explain(backend, prompt, sampling, a, b)
        assert (a.text, a.finish, a.cache_tokens) == (b.text, b.finish, b.cache_tokens)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert backend.cache_length(b.cache) == len(b.cache_tokens)  # the cache holds exactly its tokens


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def mixed_requests(
    backend: MlxModel, eos_bias: tuple[tuple[int, float], ...]
) -> list[tuple[list[int], SamplingParams]]:
    return [
        (backend.encode(COPY * 2), greedy(48, logit_bias=eos_bias, logprobs=2)),
        (backend.encode("Where does the river go? How far is the sea?"), greedy(30, logit_bias=eos_bias)),
        (backend.encode(COPY + "snow on the roofs"), greedy(40, repetition_penalty=1.3, logit_bias=eos_bias)),
        (
            backend.encode("a map " * 12),
            greedy(36, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=eos_bias),
        ),
    ]


@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_is_the_same_with_speculation_on_and_off(backend, tiny_eos_id, rows):
    """Copy-heavy prompts (drafts accepted) and others (drafts rejected), with repetition,
    presence and frequency penalties, batch 1 and 4: the same ids, text, logprobs and caches."""
    requests = mixed_requests(backend, ((tiny_eos_id, -100.0),))
    if rows == 1:
        off = [drive(open_batch(backend, 1, None), [r])[0][0] for r in requests]
        on_runs = [drive(open_batch(backend, 1, FLAT), [r]) for r in requests]
        on, stats = [r[0][0] for r in on_runs], [r[1][0] for r in on_runs]
    else:
        off, _ = drive(open_batch(backend, 4, None), requests)
        on, by_row = drive(open_batch(backend, 4, FLAT), requests)
        stats = [by_row[i] for i in range(len(requests))]
    assert_same(backend, requests, off, on)
    assert sum(s.accepted for s in stats) > 0, stats  # drafts were accepted somewhere ...
    assert sum(s.drafted - s.accepted for s in stats) > 0, stats  # ... and rejected somewhere
    assert stats[0].tokens_per_pass > 1.0, stats[0]  # the copy prompt got more than one token a pass


def test_from_a_cached_prefix(backend, tiny_eos_id):
    """A request starting from a cached prefix gives the same tokens on and off."""
    no_eos = ((tiny_eos_id, -100.0),)
    prompt = backend.encode(COPY * 2)
    sampling = greedy(40, logit_bias=no_eos, repetition_penalty=1.1)
    entry = backend.new_cache()
    list(backend.generate(prompt, greedy(1), entry))
    reuse = len(prompt) - 3
    off, _ = drive(
        open_batch(backend, 2, None), [(prompt, sampling)], kvs=[(backend.copy_cache(entry, reuse), reuse)]
    )
    on, _ = drive(
        open_batch(backend, 2, FLAT), [(prompt, sampling)], kvs=[(backend.copy_cache(entry, reuse), reuse)]
    )
    assert_same(backend, [(prompt, sampling)], off, on)


def test_a_right_prediction_is_accepted_whole(backend, tiny_eos_id):
    """A prediction equal to the real answer: every drafted token is accepted, and a pass
    yields many tokens; the output is still the model's own."""
    no_eos = ((tiny_eos_id, -100.0),)
    request = (backend.encode("Where does the river go? How far is the sea?"), greedy(40, logit_bias=no_eos))
    (off,), _ = drive(open_batch(backend, 1, None), [request])
    (on,), stats = drive(open_batch(backend, 1, FLAT), [request], predictions=[off.ids])
    assert_same(backend, [request], [off], [on])
    assert stats[0].drafted > 0 and stats[0].accepted == stats[0].drafted, stats[0]
    assert stats[0].tokens_per_pass >= 4, stats[0]


def test_mixed_acceptance_trims_each_row_to_its_own_run(backend, tiny_eos_id):
    """Four rows in one pass accept all, a third wrong, right then wrong, and prompt lookup
    alone: each row keeps only its own accepted run, so every output and
    every handed-back cache equals the run without speculation, and a second turn on each
    cache equals a cold run."""
    no_eos = ((tiny_eos_id, -100.0),)
    prompts = ["Where does the river go?", "the sea was far", "a map of the valley", "snow covered the roofs"]
    requests = [(backend.encode(p), greedy(32, logit_bias=no_eos)) for p in prompts]
    off, _ = drive(open_batch(backend, 4, None), requests)
    half = off[2].ids[:12] + [5] * 20  # right for 12 tokens, then wrong
    every_third_wrong = [t if i % 3 else (t + 1) % 500 for i, t in enumerate(off[1].ids)]
    predictions = [off[0].ids, every_third_wrong, half, None]
    on, stats = drive(open_batch(backend, 4, FLAT), requests, predictions=predictions)
    assert_same(backend, requests, off, on)
    assert stats[0].accepted == stats[0].drafted > 0
    assert 0 < stats[1].accepted < stats[1].drafted
    assert 0 < stats[2].accepted < stats[2].drafted

    follow = [
        (list(r.cache_tokens) + backend.encode(" and then?"), greedy(12, logit_bias=no_eos)) for r in on
    ]
    cold, _ = drive(open_batch(backend, 4, None), follow)
    warm, _ = drive(open_batch(backend, 4, FLAT), follow, kvs=[(r.cache, len(r.cache_tokens)) for r in on])
    assert [r.ids for r in warm] == [r.ids for r in cold]


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 10, 11])
def test_max_tokens_at_the_edge_of_a_run(backend, tiny_eos_id, max_tokens):
    """An accepted run never carries a row past max_tokens: exactly max_tokens tokens, "length"."""
    no_eos = ((tiny_eos_id, -100.0),)
    request = (backend.encode(COPY), greedy(max_tokens, logit_bias=no_eos))
    (full,), _ = drive(open_batch(backend, 1, None), [(request[0], greedy(40, logit_bias=no_eos))])
    (on,), _ = drive(open_batch(backend, 1, FLAT), [request], predictions=[full.ids])
    assert on.ids == full.ids[:max_tokens]
    assert on.finish == "length"
    assert len(on.cache_tokens) == len(request[0]) + max_tokens


def test_eos_inside_an_accepted_run_ends_the_row_there(backend, tiny_eos_id):
    """A prediction running past the model's EOS: the row stops at EOS ("stop", not counted),
    and its cache holds the tokens up to and with EOS, as without speculation."""
    # A nudge towards EOS makes the tiny model end "hi" after some 50 tokens.
    request = (backend.encode("hi"), greedy(200, logit_bias=((tiny_eos_id, 3.0),)))
    (off,), _ = drive(open_batch(backend, 1, None), [request])
    assert off.finish == "stop" and len(off.ids) > 10, off
    emitted = list(off.cache_tokens[len(request[0]) :])  # its tokens and the EOS
    (on,), stats = drive(open_batch(backend, 1, FLAT), [request], predictions=[[*emitted, 11, 12, 13]])
    assert_same(backend, [request], [off], [on])
    assert stats[0].accepted > 0


def test_seeded_sampling_gives_the_same_text(backend, tiny_eos_id):
    """A seeded sampled request gives the same tokens with speculation on and off, alone and
    beside an unseeded row, with drafts accepted along the way."""
    no_eos = ((tiny_eos_id, -100.0),)
    seeded = (
        backend.encode(COPY * 2),
        SamplingParams(temperature=0.8, seed=1234, max_tokens=40, logit_bias=no_eos),
    )
    other = (backend.encode("a map " * 8), SamplingParams(temperature=0.9, max_tokens=20, logit_bias=no_eos))
    (off,), _ = drive(open_batch(backend, 1, None), [seeded])
    (on,), stats = drive(open_batch(backend, 1, FLAT), [seeded], predictions=[off.ids])
    assert on.ids == off.ids and on.text == off.text
    assert stats[0].accepted > 0
    beside, _ = drive(open_batch(backend, 2, FLAT), [seeded, other], predictions=[off.ids, None])
    assert beside[0].ids == off.ids


def test_grammar_rows_never_draft(backend):
    """A grammar-constrained row runs without speculation (k = 0) in a speculating batch."""
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}'
    grammar = Grammar("json", schema)
    copy = (backend.encode(COPY * 2), greedy(30))
    constrained = (backend.encode("a json object:"), greedy(30, grammar=grammar))
    off, _ = drive(open_batch(backend, 2, None), [copy, constrained])
    on, stats = drive(open_batch(backend, 2, FLAT), [copy, constrained])
    assert [r.ids for r in on] == [r.ids for r in off]
    assert stats[1] is None  # no drafter: it never drafted


def test_drafting_that_does_not_pay_runs_plain_steps(backend, tiny_eos_id):
    """Under the measured CPU costs (the seed table alone, so that the run does not depend on the
    machine's speed), a row whose drafts keep failing falls back to k = 0."""
    no_eos = ((tiny_eos_id, -100.0),)
    request = (backend.encode("Where does the river go?"), greedy(120, logit_bias=no_eos))
    (off,), _ = drive(open_batch(backend, 1, None), [request])
    # Aligned at every token, wrong at every draft: [t0, x, t1, x, t2, x, ...]
    wrong = [t for token in off.ids for t in (token, (token + 1) % 500)]
    config = SpeculationConfig(measure=False)
    (on,), stats = drive(open_batch(backend, 1, config), [request], predictions=[wrong])
    assert on.ids == off.ids
    # A few wide tries while the estimate falls, then plain steps with a rare one-token probe.
    assert stats[0].accepted == 0 < stats[0].drafted <= 40, stats[0]
    assert stats[0].passes == 120


def test_a_row_removed_mid_run_leaves_the_others_exact(backend, tiny_eos_id):
    """Cancelling one speculating row between steps: it hands back a cache holding exactly its
    tokens, and the other rows still give their output without speculation."""
    no_eos = ((tiny_eos_id, -100.0),)
    requests = [
        (backend.encode(COPY * 2), greedy(40, logit_bias=no_eos)),
        (backend.encode("a map " * 10), greedy(40, logit_bias=no_eos)),
        (backend.encode("Where does the river go?"), greedy(40, logit_bias=no_eos)),
    ]
    off, _ = drive(open_batch(backend, 3, None), [requests[0], requests[2]])
    batch = open_batch(backend, 3, FLAT)
    handles = [batch.insert(p, s, None, 0) for p, s in requests]
    got: dict[int, list[int]] = {h: [] for h in handles}
    ended: set[int] = set()
    while len(ended) < len(handles):
        for step in batch.step():
            if step.token_id is not None:
                got[step.handle].append(step.token_id)
            if step.finish_reason is not None:
                ended.add(step.handle)
        if handles[1] not in ended and len(got[handles[1]]) >= 5:
            removed = batch.remove(handles[1])
            assert backend.cache_length(removed.kv) == len(removed.tokens)
            assert list(removed.tokens) == [*requests[1][0], *got[handles[1]]]
            ended.add(handles[1])
    batch.close()
    assert [got[handles[0]], got[handles[2]]] == [r.ids for r in off]
    assert batch.speculation_totals.passes > 0


def test_the_rollback_keeps_each_rows_own_positions_in_the_batch_cache():
    """The crux, on mlx-lm's `BatchKVCache` alone: after a pass of 4 positions where row 0 keeps
    1 and row 1 keeps 3, each row holds exactly its kept positions (offsets, extract, the next
    write and the mask all agree)."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import BatchKVCache

    from mlxhost.engine.backends.mlx.speculative import SpeculativeGenerationBatch

    def feed(cache: BatchKVCache, rows: list[list[float]]) -> None:
        x = mx.array(rows)[:, None, :, None]  # (rows, heads, positions, dim)
        cache.update_and_fetch(x, x)

    def held(cache: BatchKVCache, row: int) -> list[float]:
        return cache.extract(row).values[0, 0, :, 0].tolist()

    cache = BatchKVCache([1, 0])  # row 0 starts one token shorter (left padding)
    feed(cache, [[0, 10, 11], [20, 21, 22]])
    feed(cache, [[30, 31, 32, 33], [40, 41, 42, 43]])
    SpeculativeGenerationBatch._roll_back(SimpleNamespace(prompt_cache=[cache]), 4, [1, 3])
    assert held(cache, 0) == [10, 11, 30]
    assert held(cache, 1) == [20, 21, 22, 40, 41, 42]
    assert cache.offset.tolist() == [3, 6]  # each row's RoPE position: its own token count
    feed(cache, [[50], [60]])
    assert held(cache, 0) == [10, 11, 30, 50]
    assert held(cache, 1) == [20, 21, 22, 40, 41, 42, 60]
    # A next query sees exactly each row's held positions, the last ones; the rest is padding.
    visible = cache.make_mask(1)[:, 0, 0, : cache._idx].tolist()
    assert visible[0] == [False] * (cache._idx - 4) + [True] * 4
    assert visible[1] == [False] * (cache._idx - 7) + [True] * 7


def test_the_prediction_counts_are_the_prediction_tokens_the_output_reproduced(backend, tiny_eos_id):
    """OpenAI's accepted_prediction_tokens: a right prediction reproduced whole (its first,
    sampled token too, not only the drafted ones), a half-right one its right half, an
    unrelated one nothing; a row that joins a decoding batch (its first token sampled at insert)
    counts the same."""
    no_eos = ((tiny_eos_id, -100.0),)
    prompts = ["Where does the river go?", "the sea was far", "snow covered the roofs"]
    requests = [(backend.encode(p), greedy(24, logit_bias=no_eos)) for p in prompts]
    off, _ = drive(open_batch(backend, 3, None), requests)
    predictions = [off[0].ids, off[1].ids[:10] + [5] * 14, [7] * 24]
    batch = open_batch(backend, 3, FLAT)
    first = batch.insert(*requests[0], None, 0, prediction_ids=predictions[0])
    reproduced: dict[int, int] = {}
    steps = batch.step()
    while not steps:  # until the batch decodes: the next rows join it started
        steps = batch.step()
    handles = [first] + [batch.insert(*requests[i], None, 0, prediction_ids=predictions[i]) for i in (1, 2)]
    assert set(handles[1:]) <= set(batch._first)  # joined started: first tokens handed out next step
    while len(reproduced) < 3:
        for step in steps:
            if step.finish_reason is not None:
                reproduced[step.handle] = batch.prediction_reproduced(step.handle)
        steps = batch.step() if len(reproduced) < 3 else []
    batch.close()
    assert [reproduced[h] for h in handles] == [24, 10, 0], reproduced
