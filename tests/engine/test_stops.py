"""StopMatcher: stop strings split across tokens, held-back prefixes, flush."""

from __future__ import annotations

import pytest

from mlxhost.engine.stops import StopMatcher


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "stopped"),
    [
        pytest.param(["ab", "c"], (), "abc", False, id="no-stops"),
        pytest.param(["Hello ", "wor", "ld"], ("wo",), "Hello ", True, id="split-across-tokens"),
        pytest.param(["a<", "x"], ("<|end|>",), "a<x", False, id="held-prefix-released"),
        pytest.param(["xx STOP yy"], ("STOP", "xx"), "", True, id="earliest-match-wins"),
        pytest.param(["end<"], ("<|",), "end<", False, id="flushed-at-end"),
    ],
)
def test_stop_matcher(pieces, stops, expected, stopped):
    matcher = StopMatcher(stops)
    out, hit = "", False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out += text
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == (expected, stopped)


def test_the_matcher_names_the_earliest_stop_that_completed():
    """API-2: the matched stop string is reported (Anthropic's stop_sequence); none before a match."""
    matcher = StopMatcher(("STOP", "xx", "never"))
    assert matcher.feed("ab x") == ("ab ", False)
    assert matcher.matched is None
    assert matcher.feed("x STOP") == ("", True)  # "xx" completed first, at the held "x"
    assert matcher.matched == "xx"
