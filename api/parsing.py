"""Strict JSON parsing for request bodies and WebSocket frames: hostile input is a 4xx (API-4)."""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig

from api.errors import ApiError

INVALID_JSON_MESSAGE = "The request body is not valid JSON."
NOT_AN_OBJECT_MESSAGE = "The request body must be a JSON object."
TOO_DEEP_MESSAGE = "The JSON is nested too deeply."
BAD_UNICODE_MESSAGE = "The JSON contains a lone UTF-16 surrogate, which is not valid Unicode text."
TOO_LARGE_MESSAGE = "The request body is larger than {limit} bytes."
# Deeper JSON would reach the interpreter's recursion limit in later copies and encoders.
MAX_JSON_DEPTH = 64

# A `\ud800`-`\udfff` escape; a valid pair decodes to one character, a lone half stays a surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def too_large_error() -> ApiError:
    return ApiError(
        413,
        TOO_LARGE_MESSAGE.format(limit=settings.MLXHOST_MAX_REQUEST_BYTES),
        code="request_too_large",
    )


def read_body(request: Any) -> bytes:
    """The request body, counted as read (chunked bodies too).

    Raises:
        ApiError: 413 when it is over MLXHOST_MAX_REQUEST_BYTES.
    """
    try:
        body: bytes = request.body
    except RequestDataTooBig:  # Content-Length or the bytes buffered (chunked) exceed the limit
        raise too_large_error() from None
    if len(body) > settings.MLXHOST_MAX_REQUEST_BYTES:
        raise too_large_error()
    return body


def loads_object(raw: bytes | str, *, what: str = "request body") -> dict[str, Any]:
    """Parse `raw` as a JSON object whose every string is valid Unicode.

    Raises:
        ApiError: 400 `invalid_json` for bad JSON, nesting past the interpreter's recursion
            limit, a lone surrogate (it would crash later, when encoded to UTF-8), or a
            value that is not an object.
    """
    try:
        value = json.loads(raw or b"null")
    except RecursionError:
        raise ApiError(400, TOO_DEEP_MESSAGE, code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, f"The {what} is not valid JSON.", code="invalid_json") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"The {what} must be a JSON object.", code="invalid_json")
    if _may_nest(raw) and _too_deep(value):
        raise ApiError(400, TOO_DEEP_MESSAGE, code="invalid_json")
    if _may_hold_surrogates(raw) and not _encodable(value):
        raise ApiError(400, BAD_UNICODE_MESSAGE, code="invalid_json")
    return value


def _may_hold_surrogates(raw: bytes | str) -> bool:
    # json.loads decodes bytes with "surrogatepass", so raw UTF-8-encoded surrogates count too.
    if isinstance(raw, str):
        return bool(_SURROGATE_ESCAPE_TEXT.search(raw))
    return bool(_SURROGATE_ESCAPE.search(raw)) or b"\xed" in raw


def _may_nest(raw: bytes | str) -> bool:
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{") > MAX_JSON_DEPTH
    return raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return False


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
