"""An answer cut mid-character never ends with U+FFFD (issue 13), on both schedulers."""

from __future__ import annotations

import pytest

from mlxhost.engine import Delta, Done, LaneSettings
from mlxhost.engine.stops import StopMatcher
from tests.engine.conftest import collect, request, spec

# What mlx-lm's detokenizers give on their final flush for a character cut after its first byte.
CUT = "\ufffd"


@pytest.mark.parametrize("stops", [(), ("END",)])
def test_a_trailing_replacement_is_held_and_dropped_at_the_end(stops):
    matcher = StopMatcher(stops)
    assert matcher.feed("caf") == ("caf", False)
    assert matcher.feed("é " + CUT) == ("é ", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize("stops", [(), ("END",)])
def test_a_replacement_that_text_follows_is_sent_with_it(stops):
    """A U+FFFD the model really wrote, mid-answer, goes out as soon as more text comes."""
    matcher = StopMatcher(stops)
    assert matcher.feed("a" + CUT) == ("a", False)
    assert matcher.feed(CUT) == (CUT, False)
    assert matcher.feed("b") == (CUT + "b", False)
    assert matcher.flush() == ""


def test_only_the_last_replacement_is_the_cut_one():
    """Invalid bytes before the cut (one U+FFFD each) are what the model wrote: they stay."""
    matcher = StopMatcher(())
    assert matcher.feed("x" + CUT * 3) == ("x" + CUT * 2, False)
    assert matcher.flush() == ""


def test_a_stop_string_after_a_held_replacement_still_cuts():
    matcher = StopMatcher(("END",))
    assert matcher.feed("x" + CUT) == ("x", False)
    assert matcher.feed("EN") == (CUT, False)
    assert matcher.feed("D") == ("", True)


def text_and_tokens(events) -> tuple[str, int]:
    deltas = [event for event in events if isinstance(event, Delta)]
    return "".join(d.text for d in deltas), sum(len(d.token_ids) for d in deltas)


@pytest.mark.parametrize("capacity", [1, 2], ids=["exclusive", "batched"])
async def test_an_answer_cut_by_max_tokens_mid_character_ends_before_it(engine, backend, capacity):
    """The last token's text ends in an incomplete character: it is dropped, the token still counts."""
    model = spec(1, lane=LaneSettings(capacity=capacity))
    backend.enqueue(["Gr", "ü", "ße " + CUT, "never"])
    events = await collect(await engine.submit(request(spec_=model, max_tokens=3)))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert text_and_tokens(events) == ("Grüße ", 3)
    assert done.usage.completion_tokens == 3
