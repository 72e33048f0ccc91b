"""A request's choices (OpenAI `n`) as rows of one batch, on the fake backend: one prefill, a
slot and a seed per row, every lent cache given back."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from mlxhost.engine import Done, LaneSettings, RowGroup, Started
from tests.engine.conftest import collect, lane_idle, lane_of, request, spec, until

PROMPT = "choose"


def rows_of(size: int, *, seed: int | None = None, spec_=None, key: str = "g", **sampling) -> list:
    """The engine requests of one request with `size` choices."""
    return [
        replace(
            request(f"{key}-{i}", text=PROMPT, spec_=spec_, seed=seed, **sampling),
            rows=RowGroup(key, i, size),
        )
        for i in range(size)
    ]


async def run_rows(engine, requests) -> list[list]:
    generations = [await engine.submit(r) for r in requests]  # the first row first, as the turn service
    return await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)


async def test_three_choices_share_one_prefill_each_with_its_own_seed_and_slot(engine, backend):
    x = spec(1, lane=LaneSettings(capacity=4))
    await engine.load(x)
    backend.gated = True
    requests = rows_of(3, seed=41, spec_=x, max_tokens=2)
    generations = [await engine.submit(r) for r in requests]
    await until(lambda: lane_of(engine)["active"] == 3, what="the three rows to hold three slots")
    backend.gated = False
    backend.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)

    fed = [(ids, sampling.seed) for _, ids, sampling in backend.history]
    prompt_length = results[0][0].prompt_tokens
    assert len(backend.prefills) == 1 and len(backend.prefills[0]) == prompt_length - 1
    # Each row is fed the prompt's last token alone, with its own seed: 41, 42, 43.
    assert [len(ids) for ids, _ in fed] == [1, 1, 1]
    assert [seed for _, seed in fed] == [41, 42, 43]
    # Started: the first row computed its prompt (nothing cached); the others reused it.
    starts = [events[0] for events in results]
    assert all(isinstance(s, Started) for s in starts)
    assert [s.cached_tokens for s in starts] == [0, prompt_length - 1, prompt_length - 1]
    dones = [events[-1] for events in results]
    assert all(isinstance(d, Done) and d.finish_reason == "length" for d in dones)
    assert [d.usage.completion_tokens for d in dones] == [2, 2, 2]
    await lane_idle(engine)
    # One copy kept for the others, one handed to the second row; the third took the kept one.
    assert backend.copies == 2, backend.copies
    # Without a session nothing is kept: each row's own cache goes, and nothing else was left.
    assert backend.dispose_calls == 3, backend.dispose_calls


async def test_the_kept_prompt_goes_when_its_first_row_ends_before_the_others_join(engine, backend):
    """A row that joins after the first one ended starts on its own; nothing lent is left over."""
    x = spec(1, lane=LaneSettings(capacity=4))
    await engine.load(x)
    await run_rows(engine, [request("plain", text=PROMPT, spec_=x, max_tokens=1)])
    await lane_idle(engine)
    assert backend.dispose_calls == 1  # a request without a session: its cache goes at its end
    first, second = rows_of(2, spec_=x, max_tokens=1)
    [events] = await run_rows(engine, [first])
    await lane_idle(engine)
    assert backend.dispose_calls == 3  # its own cache, and the prompt it kept for the second row
    await run_rows(engine, [second])
    await lane_idle(engine)
    assert len(backend.prefills) == 1
    assert len(backend.history[-1][1]) == events[0].prompt_tokens  # it fed its whole prompt
    assert backend.dispose_calls == 4


async def test_without_a_seed_the_rows_have_none(engine, backend):
    x = spec(1, lane=LaneSettings(capacity=2))
    await engine.load(x)
    await run_rows(engine, rows_of(2, spec_=x, max_tokens=1))
    assert [sampling.seed for _, _, sampling in backend.history] == [None, None]


async def test_one_slot_runs_the_rows_one_after_another(engine, backend):
    """A lane of one slot: no batch; each row waits for its slot, and all of them end."""
    x = spec(1, lane=LaneSettings(capacity=1))
    await engine.load(x)
    results = await run_rows(engine, rows_of(3, seed=7, spec_=x, max_tokens=1))
    assert [events[-1].finish_reason for events in results] == ["length"] * 3
    assert backend.prefills == []
    assert [sampling.seed for _, _, sampling in backend.history] == [7, 8, 9]
