"""Quantized weights (issue 28, item 2) served by the engine with the real MLX backend: tiny random
llamas quantized locally by mlx-lm at 4 bits (group 32) and 8 bits (group 64), each test once per
setting. Output equals mlx-lm's own on the same folder; batching, the prefix cache and the disk
tier work on them; the KV and weights accounting counts their real bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import TYPE_CHECKING

import mlx.nn as nn
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxhost.engine import Engine, EngineConfig, LaneSettings, Message, ModelSpec, Started
from mlxhost.engine.backends.mlx.quantize import weights_bytes
from tests.engine.conftest import collect, lane_idle, until
from tests.engine.mlx.support import chat, outcome, run_together

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(180)

PROMPTS = ("hi", "The baker opened his shop.", "Where does the river go?", "snow covered the roofs")
SECRET = b"q" * 32


@pytest.fixture
async def engines(tiny_quantized_dir: Path):
    """`make(capacity, **config)`: an mlx engine serving the quantized tiny model as instance 1."""
    made: list[Engine] = []

    async def make(capacity: int, **config) -> tuple[Engine, ModelSpec]:
        engine = Engine(EngineConfig(backend="mlx", **config))
        made.append(engine)
        spec = ModelSpec(
            instance_id=1,
            source=str(tiny_quantized_dir),
            fingerprint="q" * 64,
            lane=LaneSettings(capacity=capacity),
        )
        await engine.load(spec)
        return engine, spec

    yield make
    for engine in made:
        await engine.shutdown()


def test_the_folder_holds_quantized_weights(tiny_quantized_dir, tiny_model_dir):
    """The fixture really is mlx-lm's quantized form: its config says so, mlx-lm builds quantized
    layers from it, and the weights take less than half the float32 bytes."""
    config = json.loads((tiny_quantized_dir / "config.json").read_text())
    assert config["quantization"]["bits"] in (4, 8)
    model, _ = load(str(tiny_quantized_dir))
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.QuantizedLinear in kinds and nn.Linear not in kinds
    assert weights_bytes(tiny_quantized_dir) < weights_bytes(tiny_model_dir) / 2


async def test_greedy_output_equals_mlx_lm_on_the_same_folder(engines, tiny_quantized_dir, tiny_eos_id):
    """Issue 28 "Prove it": mlxhost's greedy tokens on the quantized folder are mlx-lm's, token for token."""
    model, tokenizer = load(str(tiny_quantized_dir))
    no_eos = ((tiny_eos_id, -100.0),)
    engine, spec = await engines(1)
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        theirs = [
            int(r.token)
            for r in stream_generate(
                model,
                tokenizer,
                list(ids),
                max_tokens=16,
                sampler=make_sampler(0.0),
                logits_processors=make_logits_processors(logit_bias=dict(no_eos)),
            )
        ]
        ours = outcome(
            await collect(
                await engine.submit(chat(spec, f"r{i}", [("user", prompt)], max_tokens=16, logit_bias=no_eos))
            )
        )
        assert list(ours[1]) == theirs, prompt


async def test_batched_rows_equal_their_single_stream_output(engines, batch_sizes):
    """LANE-1 on quantized weights: four greedy rows in one batch give exactly what each gets alone."""
    sampling = {"max_tokens": 14, "frequency_penalty": 1.0}

    def requests(spec: ModelSpec) -> list:
        return [chat(spec, f"r{i}", [("user", p)], **sampling) for i, p in enumerate(PROMPTS)]

    single, single_spec = await engines(1)
    alone = [outcome(await collect(await single.submit(r))) for r in requests(single_spec)]
    batched, batched_spec = await engines(len(PROMPTS))
    together = [outcome(events) for events in await run_together(batched, requests(batched_spec))]
    assert together == alone
    assert max(batch_sizes) == len(PROMPTS)
    assert len({text for text, *_ in alone}) > 1


async def test_turn_two_reuses_the_cached_prefix_and_matches_a_cold_run(engines):
    """SES-1/SES-7 on quantized weights: the second turn starts from the first turn's KV (cached
    tokens counted by the engine), and its greedy output equals a recompute from scratch."""
    engine, spec = await engines(2)
    first = outcome(
        await collect(
            await engine.submit(
                chat(
                    spec,
                    "t1",
                    [("user", "hi")],
                    session=engine.scoper.query(tenant="a"),
                    max_tokens=10,
                    stop=(" ",),
                )
            )
        )
    )
    history = [("user", "hi"), ("assistant", first[0]), ("user", "and then?")]
    warm_query = engine.scoper.query(tenant="a", previous_response_id="t1")
    await until(lambda: "t1" in engine.get(1).sessions._entries, what="turn 1's cache to be adopted")
    warm = await collect(await engine.submit(chat(spec, "t2", history, session=warm_query, max_tokens=12)))
    cold = await collect(
        await engine.submit(chat(spec, "t3", history, session=engine.scoper.query(tenant="b"), max_tokens=12))
    )
    started = next(e for e in warm if isinstance(e, Started))
    prompt_one = len(engine.get(1).model.render_chat([Message("user", "hi")]))
    assert started.cached_tokens >= prompt_one
    assert next(e for e in cold if isinstance(e, Started)).cached_tokens == 0
    assert outcome(warm) == outcome(cold)


async def test_kv_bytes_per_token_is_what_the_cache_holds(engines):
    """The KV estimate the fit check and the prefix-cache budget use equals the real bytes held per
    token: quantizing the weights leaves the KV in the activations' dtype."""
    engine, spec = await engines(1)
    await collect(
        await engine.submit(
            chat(spec, "k", [("user", "hello")], session=engine.scoper.query(tenant="a"), max_tokens=6)
        )
    )
    await until(lambda: "k" in engine.get(1).sessions._entries, what="the cache to be adopted")
    model = engine.get(1).model
    kv = engine.get(1).sessions._entries["k"].kv
    held = model.cache_length(kv)
    assert held > 0
    assert model.cache_nbytes(model.copy_cache(kv, held)) == held * model.kv_bytes_per_token
    assert model.memory_bytes() == weights_bytes(engine.get(1).model.path)


async def test_the_disk_tier_saves_and_loads_quantized_kv(engines, tmp_path):
    """SES-9 on quantized weights: a stored turn's KV is saved when the worker is idle, and after a
    restart its continuation loads it from disk instead of replaying, with the replay's output."""
    config = {"kv_dir": str(tmp_path / "kv"), "session_secret": SECRET}
    turn_one = (Message("user", "hi"),)

    async def turn(engine, spec, request_id, messages, **query):
        request = chat(
            spec,
            request_id,
            [(m.role, m.content) for m in messages],
            session=engine.scoper.query(tenant="t", **query),
            max_tokens=8,
        )
        generation = await engine.submit(dataclasses.replace(request, keep_on_disk=True))
        events = await asyncio.wait_for(collect(generation), 60)
        await lane_idle(engine)
        return generation, events

    def disk(engine):
        return engine.snapshot()[0]["prefix_cache"]["disk"]

    engine, spec = await engines(1, **config)
    _, first = await turn(engine, spec, "p", turn_one)
    await until(lambda: disk(engine)["written"] == 1, what="the idle worker to save the stored turn")
    await engine.shutdown()

    turn_two = (*turn_one, Message("assistant", outcome(first)[0]), Message("user", "and more?"))
    engine, spec = await engines(1, **config)
    generation, events = await turn(engine, spec, "c", turn_two, previous_response_id="p")
    assert generation.session_outcome == "disk"
    prompt_one = len(engine.get(1).model.render_chat(list(turn_one)))
    assert next(e for e in events if isinstance(e, Started)).cached_tokens >= prompt_one
    replay, replay_spec = await engines(1)
    _, cold = await turn(replay, replay_spec, "r", turn_two)
    assert outcome(events) == outcome(cold)


def test_a_bfloat16_copy_counts_its_kv_at_two_bytes(tiny_model_dir, tmp_path):
    """mlx-community's usual form (bfloat16 scales): the KV is bfloat16 too, and the estimate the
    budget uses is half the float32 one and equals the bytes the cache holds."""
    from mlx_lm import convert

    from mlxhost.engine import SamplingParams
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    folder = tmp_path / "bf16-4bit"
    convert(str(tiny_model_dir), str(folder), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    backend = MlxBackend()
    models = [
        backend.load(ModelSpec(i, str(f), "b" * 64), lambda *_: None)
        for i, f in enumerate((tiny_model_dir, folder))
    ]
    full, copy = models
    try:
        assert copy.kv_bytes_per_token * 2 == full.kv_bytes_per_token
        kv = copy.new_cache()
        steps = list(copy.generate(copy.encode("hello"), SamplingParams(temperature=0.0, max_tokens=4), kv))
        assert steps
        held = copy.cache_length(kv)
        assert copy.cache_nbytes(copy.copy_cache(kv, held)) == held * copy.kv_bytes_per_token
    finally:
        for model in models:
            model.close()
