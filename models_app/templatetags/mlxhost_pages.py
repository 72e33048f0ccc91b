"""Template filters for the staff pages' script data: strict JSON, never `NaN` or `Infinity`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import template
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.html import json_script

from mlxhost import wire

if TYPE_CHECKING:
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
