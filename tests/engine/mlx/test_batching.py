"""Continuous batching with the real tiny MLX model: batched output equals single-stream output."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm import load
from tokenizers import Tokenizer

from mlxhost.engine import (
    Delta,
    GenerationRequest,
    Message,
    ModelSpec,
    SamplingParams,
)
from mlxhost.engine.backends.mlx.batch import PREFILL_STEP, MlxBatch
from tests.engine.conftest import collect, until
from tests.engine.mlx.support import chat, outcome, run_together, submit_together

pytestmark = pytest.mark.timeout(120)

# Words absent from the tiny tokenizer's corpus: the model itself never spells them out.
MARKERS = ("zebra", "quokka", "violin", "saffron", "tundra", "cobalt", "pixel", "lagoon")


async def test_greedy_batched_output_equals_single_stream_output(engines, batch_sizes, tiny_eos_id):
    """LANE-1: six greedy requests (different prompt lengths, limits and processors) batched as one
    give exactly the tokens, text and usage each gets alone."""
    cases = [
        ("hi", {"max_tokens": 8}),
        ("The baker opened his shop before the sun was up.", {"max_tokens": 20}),
        ("river", {"max_tokens": 12, "frequency_penalty": 1.0}),
        ("Where does the river go? How far is the sea?", {"max_tokens": 24, "frequency_penalty": 1.0}),
        ("a map of the valley", {"max_tokens": 16, "logit_bias": ((tiny_eos_id, -100.0),)}),
        ("snow covered the roofs", {"max_tokens": 10, "repetition_penalty": 1.3, "top_k": 5}),
    ]

    def requests(spec: ModelSpec) -> list[GenerationRequest]:
        return [chat(spec, f"r{i}", [("user", text)], **kw) for i, (text, kw) in enumerate(cases)]

    single, single_spec = await engines(1)
    alone = [outcome(await collect(await single.submit(r))) for r in requests(single_spec)]
    batched, batched_spec = await engines(len(cases))
    together = [outcome(events) for events in await run_together(batched, requests(batched_spec))]

    assert together == alone
    assert max(batch_sizes) == len(cases)  # they really shared decode steps
    assert len({text for text, *_ in alone}) > 1  # distinct outputs, so a mix-up would show


async def test_a_cancel_mid_batch_leaves_the_other_streams_intact(engines, batch_sizes, tiny_eos_id):
    """LANE-6: one of three batched streams is cancelled after a few tokens; the other two
    still produce exactly their single-stream output, and the cancelled one stops at once."""
    no_eos = {"logit_bias": ((tiny_eos_id, -100.0),), "frequency_penalty": 1.0}
    texts = ["the first story", "a second, longer story about the river", "third"]
    limits = [30, 100_000, 24]

    def requests(spec: ModelSpec) -> list[GenerationRequest]:
        return [
            chat(spec, f"r{i}", [("user", t)], max_tokens=n, **no_eos)
            for i, (t, n) in enumerate(zip(texts, limits, strict=True))
        ]

    single, single_spec = await engines(1)
    alone = [outcome(await collect(await single.submit(r))) for r in requests(single_spec)[::2]]

    batched, batched_spec = await engines(3)
    generations = await submit_together(batched, requests(batched_spec))

    async def cancel_after(generation, tokens: int) -> list:
        events: list = []
        async for event in generation.stream():
            events.append(event)
            if not generation.cancelled and len(outcome_ids(events)) >= tokens:
                assert batched.cancel(generation.request_id)
        return events

    results = await asyncio.wait_for(
        asyncio.gather(collect(generations[0]), cancel_after(generations[1], 5), collect(generations[2])), 60
    )
    assert [outcome(results[0]), outcome(results[2])] == alone
    cancelled = results[1][-1]
    assert cancelled.finish_reason == "cancelled"
    assert cancelled.usage.completion_tokens == len(outcome_ids(results[1])) < 30
    assert max(batch_sizes) == 3


def outcome_ids(events: list) -> tuple[int, ...]:
    return tuple(t for e in events if isinstance(e, Delta) for t in e.token_ids)


async def test_eight_conversations_never_leak_into_each_other(engines, batch_sizes, tiny_model_dir):
    """SES-1 / SES-5 / LANE-1: 8 concurrent two-turn conversations, each with a unique marker word.

    Each batched turn equals that conversation's own single-stream output, each adopted cache
    holds only its own conversation, and no marker shows up in another conversation.
    """
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompts = [f"Remember the word {marker} and say it back." for marker in MARKERS]
    sampling = {"max_tokens": 16, "frequency_penalty": 1.0}  # penalties make outputs prompt-dependent
    single, single_spec = await engines(1)
    batched, batched_spec = await engines(len(MARKERS))

    # Turn 1: a stop string taken from the unstopped output ends each turn cleanly, so it is adopted.
    probes = [
        outcome(await collect(await single.submit(chat(single_spec, f"p{i}", [("user", p)], **sampling))))
        for i, p in enumerate(prompts)
    ]
    stops = [(text[len(text) // 2 : len(text) // 2 + 2],) if len(text) >= 4 else () for text, *_ in probes]
    alone = [
        outcome(
            await collect(
                await single.submit(chat(single_spec, f"s{i}", [("user", p)], stop=stop, **sampling))
            )
        )
        for i, (p, stop) in enumerate(zip(prompts, stops, strict=True))
    ]
    sessions = [batched.scoper.query(tenant=f"tenant-{i}") for i in range(len(MARKERS))]
    turn_one = [
        chat(batched_spec, f"c{i}", [("user", p)], session=q, stop=stop, **sampling)
        for i, (p, q, stop) in enumerate(zip(prompts, sessions, stops, strict=True))
    ]
    together = [outcome(events) for events in await run_together(batched, turn_one)]
    assert together == alone
    assert {finish for _, _, finish, _ in together} == {"stop"}
    assert len({text for text, *_ in probes}) >= len(MARKERS) // 2
    assert max(batch_sizes) == len(MARKERS)

    # Each handed-back cache holds exactly its own conversation.
    warm = batched.get(1).sessions
    # Adoption runs on the loop right after each Done.
    await until(lambda: len(warm._entries) >= len(MARKERS), what="every cache to be adopted")
    entries = warm._entries
    assert sorted(entries) == sorted(f"c{i}" for i in range(len(MARKERS)))
    model = batched.get(1).model
    for i, marker in enumerate(MARKERS):
        entry = entries[f"c{i}"]
        assert len(entry.tokens) == model.cache_length(entry.kv)  # exactly the tokens it holds
        prompt_ids = model.render_chat([Message("user", prompts[i])])
        assert entry.tokens[: len(prompt_ids)] == tuple(prompt_ids)
        held = tokenizer.decode(list(entry.tokens))
        assert marker in held
        assert not [m for m in MARKERS if m != marker and m in held], held

    # Turn 2, all at once on their warm caches, equals a cold single-stream recompute.
    histories = [
        [("user", p), ("assistant", text), ("user", "And again?")]
        for p, (text, *_) in zip(prompts, together, strict=True)
    ]
    cold = [
        outcome(await collect(await single.submit(chat(single_spec, f"cold{i}", h, **sampling))))
        for i, h in enumerate(histories)
    ]
    follow_ups = [
        chat(
            batched_spec,
            f"d{i}",
            h,
            session=batched.scoper.query(tenant=f"tenant-{i}", previous_response_id=f"c{i}"),
            **sampling,
        )
        for i, h in enumerate(histories)
    ]
    warm_events = await run_together(batched, follow_ups)
    assert all(events[0].cached_tokens > 0 for events in warm_events)  # every one hit its own session
    assert [outcome(events) for events in warm_events] == cold

    for i, (text, *_) in enumerate([*together, *(outcome(e) for e in warm_events)]):
        own = MARKERS[i % len(MARKERS)]
        assert not [m for m in MARKERS if m != own and m in text]


def test_a_long_prompt_is_prefilled_between_decode_steps(tiny_model_dir, tiny_eos_id):
    """LANE-1: a long prompt joining a busy batch is prefilled in PREFILL_STEP-token chunks, one per
    decode step, so every running stream still gets a token on every step; all outputs equal the
    ones with the whole prompt prefilled in one chunk (mlx-lm's default, which froze the streams)."""
    model, tokenizer = load(str(tiny_model_dir))
    no_eos = ((tiny_eos_id, -100.0),)
    running = SamplingParams(temperature=0.0, max_tokens=10_000, logit_bias=no_eos, frequency_penalty=1.0)
    story = tokenizer.encode(" ".join(MARKERS) + " and the river ran to the sea. " * 80)
    long_ids = story[: 5 * PREFILL_STEP]
    joining = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=no_eos, frequency_penalty=1.0)

    def arrival(batch: MlxBatch) -> tuple[list[list[int]], list[set[int]], list[int]]:
        """Two streams run, the long prompt joins; each one's first tokens, and who got one per step."""
        handles = [batch.insert(tokenizer.encode(t), running, None, 0) for t in ("the baker", "a map")]
        tokens: dict[int, list[int]] = {h: [] for h in handles}

        def step() -> set[int]:
            steps = batch.step()
            for s in steps:
                tokens[s.handle].append(s.token_id)
            return {s.handle for s in steps}

        while min(len(t) for t in tokens.values()) < 3:
            step()
        newcomer = batch.insert(long_ids, joining, None, 0)
        tokens[newcomer] = []
        served = []  # which handles got a token, per step, until the newcomer's first token
        while not tokens[newcomer]:
            served.append(step())
        while len(tokens[newcomer]) < joining.max_tokens or min(len(tokens[h]) for h in handles) < 30:
            step()
        batch.close()
        return [tokens[h][:30] for h in (*handles, newcomer)], served, handles

    chunked, served, handles = arrival(MlxBatch(model, tokenizer, 3))
    whole, whole_served, _ = arrival(
        MlxBatch(model, tokenizer, 3, prefill_step=2048, prefill_step_alone=2048)
    )

    assert chunked == whole
    assert len(served) > len(long_ids) // PREFILL_STEP  # one chunk per step, then its first token
    assert all(set(handles) <= got for got in served)  # no step left a running stream out
    assert len(whole_served) < len(served)  # one chunk: the streams waited the whole prefill out


@pytest.mark.parametrize("penalty", [None, 1.5], ids=["no-penalty", "repetition-penalty"])
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-prefix"])
def test_an_arrival_mid_decode_gets_its_first_token_on_the_next_step(
    tiny_model_dir, tiny_eos_id, penalty, cached
):
    """Issue 12: a short prompt joining a decoding batch has its first token on the very next
    step (no batch step runs before it), and then exactly the tokens it gets alone."""
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    model = MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)
    no_eos = ((tiny_eos_id, -100.0),)
    running = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=no_eos)
    arrival = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=penalty, logit_bias=no_eos)
    prompt = model.encode("The river ran past the old mill and the baker's shop.")
    alone = [s.token_id for s in model.generate(prompt, arrival, model.new_cache()) if hasattr(s, "token_id")]
    kv, reuse = None, 0
    if cached:  # start from a copy of a cached entry holding most of the prompt
        entry = model.new_cache()
        list(model.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), entry))
        reuse = len(prompt) - 3
        kv = model.copy_cache(entry, reuse)

    batch = model.open_batch(4)
    first = batch.insert(model.encode("snow on the roofs of the town"), running, None, 0)
    while not any(s.handle == first and s.token_id is not None for s in batch.step()):
        continue  # until the first sequence decodes
    handle = batch.insert(prompt, arrival, kv, reuse)
    next_steps = batch.step()
    assert [(s.handle, s.token_id) for s in next_steps] == [(handle, alone[0])]
    tokens = [alone[0]]
    while True:
        step = next((s for s in batch.step() if s.handle == handle), None)
        if step is None:
            continue
        if step.token_id is not None:
            tokens.append(step.token_id)
        if step.finish_reason is not None:
            break
    assert tokens == alone
    batch.close()
    model.close()


def test_arrivals_past_the_prefill_budget_are_prefilled_together(tiny_model_dir, tiny_eos_id):
    """Issue 12: between two steps, arrivals are fed alone only up to one prefill chunk's budget
    (PREFILL_STEP tokens); the rest join the generator's batched prefill."""
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    model = MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((tiny_eos_id, -100.0),))
    batch = model.open_batch(4)
    running = batch.insert(model.encode("snow on the roofs of the town"), sampling, None, 0)
    while not any(s.handle == running and s.token_id is not None for s in batch.step()):
        continue
    short, other = model.encode("the river"), model.encode("bread and butter")
    over = model.encode("a quiet morning " * 40)[: PREFILL_STEP - len(short) - len(other) + 1]
    first = batch.insert(short, sampling, None, 0)
    also = batch.insert(other, sampling, None, 0)  # still within the budget: fed alone too
    second = batch.insert(over, sampling, None, 0)  # one token over it
    assert [s.handle for s in batch.step()] == [first, also]
    seen: set[int] = set()
    for _ in range(6):
        seen |= {s.handle for s in batch.step() if s.token_id is not None}
    assert second in seen
    batch.close()
    model.close()
