"""Template filters for the staff pages: script data as strict JSON (never `NaN` or `Infinity`),
and the console's words for times and ids (`models_app.console.words`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import template
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.html import json_script

from mlxhost import wire
from models_app.console import words

if TYPE_CHECKING:
    from datetime import datetime

    from django.utils.safestring import SafeString

register = template.Library()


class _PageEncoder(DjangoJSONEncoder):
    """What `json_script` encodes with: the project's strict writer (`wire.page_dumps`)."""

    def encode(self, o: Any) -> str:
        return wire.page_dumps(o)


@register.filter(is_safe=True)
def strict_json_script(value: Any, element_id: str | None = None) -> SafeString:
    """Django's `json_script` (the same escaping and `<script>` element), its JSON written by
    `wire.page_dumps`: a non-finite number is `null`, which `JSON.parse` reads, not `NaN`."""
    return json_script(value, element_id, encoder=_PageEncoder)


@register.filter
def ago(value: datetime | None) -> str:
    """ "just now" within a minute, else "3 hours ago": one rule on every page."""
    return words.relative_time(value) if value is not None else ""


@register.filter
def short_id(value: str) -> str:
    """A response id cut to a glanceable length (the full one goes in a title)."""
    return words.short_response_id(value)
