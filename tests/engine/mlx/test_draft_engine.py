"""A model with a draft model served by the engine (issue 27 item 3): both schedulers give the
same answers with the draft on and off, stop strings inside accepted runs included, the
worker's speculation counts hold the draft model's drafts, and a draft with another vocabulary
fails the load with a clear reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxhost.engine import Engine, EngineConfig, LaneSettings, ModelSpec
from mlxhost.engine.backends.mlx import backend as mlx_backend
from mlxhost.engine.backends.mlx.draft_model import DraftCost
from mlxhost.engine.errors import ModelLoadError
from tests.engine.mlx.support import chat, outcome, run_together
from tests.engine.mlx.test_speculation import COPY, FLAT

pytestmark = pytest.mark.timeout(300)


def raw(spec: ModelSpec, request_id: str, text: str, **sampling: object):
    """A text completion: the tiny models answer every chat template with one repeated token."""
    return replace(chat(spec, request_id, [], **sampling), prompt=text)


@pytest.fixture
def drafting(monkeypatch) -> None:
    """Every pass drafts (flat costs, draft forwards priced at nothing), whatever the machine."""
    monkeypatch.setattr(mlx_backend, "SpeculationConfig", lambda: FLAT)
    monkeypatch.setattr(mlx_backend, "DraftCost", lambda share: DraftCost(0.0, measured=False))


@pytest.fixture
async def drafted(tiny_model_dir):
    """`make(capacity, draft_folder)`: an engine serving the tiny model with that draft."""
    made: list[Engine] = []

    async def make(capacity: int, draft_folder) -> tuple[Engine, ModelSpec]:
        engine = Engine(EngineConfig(backend="mlx"))
        made.append(engine)
        draft = ModelSpec(instance_id=2, source=str(draft_folder), fingerprint="d" * 64)
        spec = ModelSpec(
            instance_id=1,
            source=str(tiny_model_dir),
            fingerprint="f" * 64,
            lane=LaneSettings(capacity=capacity),
            draft=draft,
        )
        await engine.load(spec)
        return engine, spec

    yield make
    for engine in made:
        await engine.shutdown()


@pytest.mark.parametrize("capacity", [1, 3], ids=["exclusive", "batched"])
async def test_answers_and_stop_strings_are_the_same_with_the_draft_on_and_off(
    drafted, drafting, tiny_model_dir, capacity, tiny_eos_id
):
    """The target's own weights as its draft: every draft accepted, so a stop string taken from
    the middle of the answer lands inside an accepted run; with penalties, beside another row."""
    engine, spec = await drafted(capacity, tiny_model_dir)
    sampling = {"max_tokens": 48, "repetition_penalty": 1.1, "logit_bias": ((tiny_eos_id, -100.0),)}
    base = raw(spec, "probe", COPY * 2, **sampling)
    (probe,) = await run_together(engine, [replace(base, max_draft=0)])
    text = outcome(probe)[0]
    cut = next(i for i in range(len(text) // 2, len(text) - 4) if text.find(text[i : i + 4]) == i)
    stop = text[cut : cut + 4]
    stats = engine.get(1)._worker.stats
    before = replace(stats.speculation)
    off, on = [
        outcome(
            (
                await run_together(
                    engine, [replace(raw(spec, name, COPY * 2, stop=(stop,), **sampling), max_draft=k)]
                )
            )[0]
        )
        for name, k in (("off", 0), ("on", 8))
    ]
    assert on == off
    assert off[0] == text[:cut] and off[2] == "stop" and off[3] > 8, (off, text)
    counts = stats.speculation
    drafted_now, accepted_now = counts.drafted - before.drafted, counts.accepted - before.accepted
    assert drafted_now > 0 and accepted_now == drafted_now, (before, counts)
    assert counts.emitted - before.emitted > 0


async def test_batched_rows_with_another_draft_are_the_same(drafted, drafting, tiny_model_b_dir, tiny_eos_id):
    engine, spec = await drafted(3, tiny_model_b_dir)
    no_eos = ((tiny_eos_id, -100.0),)
    # Raw text, not chats: the tiny models answer every chat template with the same token.
    prompts = [COPY * 2, "Where does the river go? How far is the sea?", "a map " * 12]
    requests = [
        replace(chat(spec, f"r{i}", [], max_tokens=30, logit_bias=no_eos), prompt=p)
        for i, p in enumerate(prompts)
    ]
    off = [outcome(e) for e in await run_together(engine, [replace(r, max_draft=0) for r in requests])]
    on = [outcome(e) for e in await run_together(engine, requests)]
    assert on == off
    counts = engine.get(1)._worker.stats.speculation
    assert 0 < counts.accepted < counts.drafted, counts


async def test_a_draft_with_another_vocabulary_fails_the_load_in_words(drafted, tiny_tools_model_dir):
    with pytest.raises(ModelLoadError, match="a draft must use the same tokenizer"):
        await drafted(3, tiny_tools_model_dir)
