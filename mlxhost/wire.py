"""The one JSON writer of every surface (HTTP bodies, SSE frames, WebSocket frames): strict JSON.

Python's `json` writes NaN and ±Infinity as bare `NaN` / `-Infinity`, which is not JSON:
`JSON.parse`, serde and Go reject the whole answer. Here they are refused instead
(`allow_nan=False`): a value like that is a server fault, and the surface answers with a clean
error in its envelope rather than a body no client can read.
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.http import JsonResponse

# Compact and UTF-8, as every stream frame has been written.
STRICT: dict[str, Any] = {"allow_nan": False, "separators": (",", ":"), "ensure_ascii": False}


class NotJSONError(ValueError):
    """An answer holds a value JSON cannot carry (NaN or Infinity); it was not written."""


def dumps(data: Any) -> str:
    """`data` as strict JSON text (dates, decimals and UUIDs as Django writes them).

    Raises:
        NotJSONError: `data` holds NaN or ±Infinity.
    """
    try:
        return json.dumps(data, cls=DjangoJSONEncoder, **STRICT)
    except ValueError as exc:  # "Out of range float values are not JSON compliant"
        raise NotJSONError(str(exc)) from exc


def finite(data: Any) -> Any:
    """`data` with every NaN and ±Infinity float (in dicts, lists and tuples) as None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite(value) for value in data]
    return data


def page_dumps(data: Any) -> str:
    """`data` as strict JSON for a page's script data: a value JSON cannot carry is written as
    null (a chart shows a gap, a cell a dash), so one odd number never breaks the whole page."""
    return dumps(finite(data))


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> JsonResponse:
    """A JSON response written by `dumps`.

    Raises:
        NotJSONError: `data` holds NaN or ±Infinity (an API view's decorator makes it a 500
        in the surface's envelope).
    """
    try:
        return JsonResponse(data, status=status, headers=headers, safe=False, json_dumps_params=STRICT)
    except ValueError as exc:
        raise NotJSONError(str(exc)) from exc
