"""A grammar that fails while generating, with the real tiny MLX model: one log line, an error."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from mlxhost.engine import Delta, Done, Failed
from mlxhost.engine.backends.mlx import batch as mlx_batch
from mlxhost.engine.backends.mlx.grammar import GrammarProcessor
from mlxhost.engine.errors import GrammarFailedError
from tests.engine.conftest import collect
from tests.engine.mlx.support import chat, run_together
from tests.engine.mlx.test_structured import SCHEMA

pytestmark = pytest.mark.timeout(120)


class _Breaking(GrammarProcessor):
    """Refuses the first sampled token, as a matcher whose grammar fails mid-answer does."""

    def __call__(self, tokens, logits):
        if self._started:
            raise GrammarFailedError("the sampled token broke the grammar: test")
        return super().__call__(tokens, logits)


@pytest.fixture
def breaking_grammar(monkeypatch) -> None:
    monkeypatch.setattr(mlx_batch, "GrammarProcessor", _Breaking)


@pytest.mark.parametrize("capacity", [1, 3], ids=["exclusive", "batched"])
async def test_a_grammar_failing_mid_answer_logs_one_line_with_the_request_id(
    engines, breaking_grammar, caplog, capacity
):
    """Issue 25 §5: the turn ends with an error; the log has one warning naming the request and
    no traceback; the others in the batch, and later requests, are served."""
    engine, spec = await engines(capacity)
    plain = chat(spec, "plain", [("user", "hi")], max_tokens=6)
    typed = replace(chat(spec, "typed-1", [("user", "hi")], max_tokens=6), json_format=SCHEMA)
    caplog.set_level(logging.WARNING)
    if capacity == 1:
        results = [await collect(await engine.submit(typed)), await collect(await engine.submit(plain))]
    else:
        results = await run_together(engine, [typed, plain])
    assert isinstance(results[0][-1], Failed)
    assert isinstance(results[1][-1], Done)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    lines = [r.getMessage() for r in caplog.records if "typed-1" in r.getMessage()]
    assert lines == ["generation typed-1 failed: the sampled token broke the grammar: test"]
    assert engine.get(1)._worker.stats.faults == 0
    assert isinstance((await collect(await engine.submit(replace(plain, request_id="after"))))[-1], Done)


@pytest.mark.parametrize("capacity", [1, 3], ids=["exclusive", "batched"])
async def test_stop_strings_never_cut_a_json_answer(engines, capacity):
    """API-7: stops that any JSON object contains (`{`, `"`, `:`) do not end a JSON answer: it
    is valid JSON for the schema, or cut by max_tokens (was: `stop` with the empty text)."""
    engine, spec = await engines(capacity)
    requests = [
        replace(
            chat(spec, f"j{i}", [("user", "describe a thing")], max_tokens=60, stop=("{", '"', ":"), **s),
            json_format=SCHEMA,
        )
        for i, s in enumerate([{}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}])
    ]
    for events in await run_together(engine, requests):
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason in ("stop", "length"), done
        if done.finish_reason == "stop":
            assert done.stop_sequence is None
            assert set(json.loads("".join(e.text for e in events if isinstance(e, Delta)))) == {
                "name",
                "tags",
            }
