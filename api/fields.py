"""`JsonInput`: the base of every request serializer, whose fields take only their own JSON type.

DRF coerces: a CharField takes `5` as "5", a FloatField takes `true` as 1.0 and "0.5" as 0.5, a
BooleanField takes "yes". OpenAI and Anthropic refuse a value of the wrong JSON type with a 400
naming the field, and so does this server (API-4): every declared field is checked here, by its
class, before DRF converts anything, children of list and dict fields included. JSONFields take
any JSON; the code that reads them checks their shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import serializers
from rest_framework.fields import empty

# Field class -> (the Python types json.loads gives for it, its name in a message). First match
# wins, so subclasses come before their bases.
FIELD_TYPES: tuple[tuple[type[serializers.Field[Any, Any, Any, Any]], tuple[type, ...], str], ...] = (
    (serializers.BooleanField, (bool,), "a boolean"),
    (serializers.IntegerField, (int,), "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.ChoiceField, (str,), "a string"),  # every choice list here is strings
    (serializers.CharField, (str,), "a string"),
    (serializers.ListField, (list,), "an array"),
    (serializers.DictField, (dict,), "an object"),
)
JSON_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: a bool is an int in Python, never in JSON
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)
TYPE_MESSAGE = "expected {expected}, but got {got} instead."


def json_type_name(value: Any) -> str:
    return next((name for kind, name in JSON_NAMES if isinstance(value, kind)), "null")


def type_error(field: serializers.Field[Any, Any, Any, Any], value: Any) -> Any:
    """DRF-shaped errors for a `value` of the wrong JSON type for `field` (a list of messages, or
    a dict by index or key for a list or dict field's children), or None when its type fits.
    Null is left to DRF (`allow_null`), and nested serializers check their own fields."""
    if value is None:
        return None
    for kind, accepted, expected in FIELD_TYPES:
        if isinstance(field, kind):
            wrong = not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted)
            if wrong:
                return [TYPE_MESSAGE.format(expected=expected, got=json_type_name(value))]
            break
    if isinstance(field, serializers.ListField):
        items = {i: type_error(field.child, item) for i, item in enumerate(value)}
    elif isinstance(field, serializers.DictField):
        items = {key: type_error(field.child, item) for key, item in value.items()}
    else:
        return None
    return {at: error for at, error in items.items() if error is not None} or None


class JsonInput(serializers.Serializer[Any]):
    """A request serializer: a value of the wrong JSON type is a 400 naming its field (API-4)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            errors: dict[str, Any] = {}
            for field in self._writable_fields:
                value = field.get_value(data)
                error = None if value is empty else type_error(field, value)
                if error is not None:
                    errors[str(field.field_name)] = error
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class MetadataField(serializers.DictField):
    """OpenAI's `metadata`: at most 16 pairs, keys of at most 64 characters, string values of at
    most 512. It is stored with the response and echoed by every read of it, so it stays small."""

    child = serializers.CharField(max_length=MAX_METADATA_VALUE_CHARS, allow_blank=True)

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if isinstance(data, dict):  # before the values: an error names the key, kept short
            if len(data) > MAX_METADATA_PAIRS:
                raise serializers.ValidationError(
                    f"at most {MAX_METADATA_PAIRS} key-value pairs, not {len(data)}."
                )
            if any(len(key) > MAX_METADATA_KEY_CHARS for key in data):
                raise serializers.ValidationError(f"keys may be at most {MAX_METADATA_KEY_CHARS} characters.")
        value: dict[str, str] = super().to_internal_value(data)
        return value
