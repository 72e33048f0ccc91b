"""The console's words for times and ids (issue 25 §7): one "how long ago" rule on every page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from models_app.console.words import relative_time, short_response_id

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def test_a_moment_is_just_now_then_seconds_then_the_largest_unit():
    assert relative_time(NOW, NOW) == "just now"
    assert relative_time(NOW - timedelta(seconds=4), NOW) == "just now"
    assert relative_time(NOW - timedelta(seconds=12), NOW) == "12\xa0seconds ago"
    assert relative_time(NOW - timedelta(seconds=59), NOW) == "59\xa0seconds ago"
    assert relative_time(NOW - timedelta(seconds=60), NOW) == "1\xa0minute ago"
    assert relative_time(NOW - timedelta(hours=3, minutes=5), NOW) == "3\xa0hours ago"


def test_a_response_id_is_shortened_after_its_prefix():
    assert short_response_id("resp_0123456789abcdef") == "resp_01234567\u2026"
    assert short_response_id("resp_b") == "resp_b"
    assert short_response_id("0123456789abc") == "01234567\u2026"
