"""How the console words times and ids for people: one rule for "how long ago" on every page
(server-rendered here, the scripts follow it), and short forms of response ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.utils import timezone
from django.utils.timesince import timesince

if TYPE_CHECKING:
    from datetime import datetime

# The rule, mirrored by static/mlxhost/dashboard.js (ago): under 5 s "just now", under a minute
# "12 seconds ago", then the largest unit ("3 hours ago"); never "0 minutes ago".
JUST_NOW_S = 5
SHORT_ID_CHARS = 8


def relative_time(when: datetime, now: datetime | None = None) -> str:
    """How long ago `when` was, in the console's one rule (see JUST_NOW_S)."""
    now = now or timezone.now()
    seconds = int((now - when).total_seconds())
    if seconds < JUST_NOW_S:
        return "just now"
    if seconds < 60:
        return f"{seconds}\xa0seconds ago"
    return timesince(when, now).split(",")[0] + " ago"


def short_response_id(response_id: str) -> str:
    """`resp_0123456789abcdef…` as `resp_01234567…`: enough to tell replies apart at a glance."""
    prefix, sep, rest = response_id.partition("_")
    if not sep:
        prefix, rest = "", response_id
    if len(rest) <= SHORT_ID_CHARS:
        return response_id
    return f"{prefix}{sep}{rest[:SHORT_ID_CHARS]}\u2026"
