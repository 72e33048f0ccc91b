"""Text stop strings under a grammar (fake backend, API-7): they never cut JSON into invalid JSON."""

from __future__ import annotations

import json
from dataclasses import replace

from tests.engine.conftest import collect, request
from tests.engine.test_answers import WEATHER, text_of

ANSWER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


async def _run(engine, backend, pieces, stop, **fields):
    backend.enqueue(pieces)
    return await collect(await engine.submit(replace(request(max_tokens=64, stop=stop), **fields)))


async def test_a_stop_string_inside_a_json_answer_does_not_end_it(engine, backend):
    """Was: text `{` and finish `stop` (the stop `"` cut the JSON)."""
    events = await _run(engine, backend, ['{"city": ', '"Oslo"}'], ('"',), json_format=ANSWER)
    assert json.loads(text_of(events)) == {"city": "Oslo"}
    assert events[-1].finish_reason == "stop" and events[-1].stop_sequence is None
    assert backend.history[-1][2].stop == ()


async def test_a_stop_string_still_ends_free_text_beside_tools(engine, backend):
    """Tools-only `auto` may answer text: there a stop string ends it as without tools."""
    events = await _run(engine, backend, ["Hello", " END", " more"], ("END",), tools=(WEATHER,))
    assert text_of(events) == "Hello " and events[-1].finish_reason == "stop"
    assert events[-1].stop_sequence == "END"
