"""Input validation for the OpenAI chat completions body (DRF serializers used for validation only)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from api.sampling import MAX_STOP_SEQUENCES, SamplingInput

ROLE_ALIASES = {"developer": "system"}
UNSUPPORTED_OPTIONS = {
    "tools": "Tool calling is not supported by this server.",
    "functions": "Function calling is not supported by this server.",
    "response_format": "response_format is not supported by this server.",
    "audio": "Audio output is not supported by this server.",
}


def content_text(value: Any) -> str:
    """A message's content as text: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise serializers.ValidationError("Only text content parts are supported.")
            texts.append(part["text"])
        return "".join(texts)
    raise serializers.ValidationError("Content must be a string or a list of text parts.")


class MessageInput(serializers.Serializer[Any]):
    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant"])
    content = serializers.JSONField()
    name = serializers.CharField(required=False, max_length=64)

    def validate_content(self, value: Any) -> str:
        return content_text(value)

    def validate_role(self, value: str) -> str:
        return ROLE_ALIASES.get(value, value)


class StreamOptionsInput(serializers.Serializer[Any]):
    include_usage = serializers.BooleanField(required=False, default=False)


class StrictBooleanField(serializers.BooleanField):
    """JSON booleans only: "yes" or 1 are mistakes, not flags."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class TextSamplingInput(SamplingInput):
    """Chat and text completions: `stop` may also be one string."""

    stop = serializers.JSONField(required=False, allow_null=True)

    def validate_stop(self, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise serializers.ValidationError("stop must be a non-empty string or a list of them.")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise serializers.ValidationError(f"At most {MAX_STOP_SEQUENCES} stop sequences.")
        return stops


class ChatCompletionInput(TextSamplingInput):
    messages = MessageInput(many=True, allow_empty=False)
    stream = StrictBooleanField(required=False, default=False)
    stream_options = StreamOptionsInput(required=False, allow_null=True)
    max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1)
    logprobs = StrictBooleanField(required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    # Warm-session scoping (SES-2/3): only HMAC fingerprints of these are kept.
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=1024)
    cache_salt = serializers.CharField(required=False, allow_null=True, max_length=1024)

    def validate_logprobs(self, value: bool | None) -> bool | None:
        if value:
            raise serializers.ValidationError("logprobs are not supported by this server.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, message in UNSUPPORTED_OPTIONS.items():
            if self.initial_data.get(name):
                raise serializers.ValidationError({name: message})
        attrs["max_tokens"] = attrs.get("max_completion_tokens") or attrs.get("max_tokens")
        return attrs


def first_error(errors: Any, path: str = "") -> tuple[str, str]:
    """The first (param, message) in DRF's nested errors, with a path like `messages[0].role`."""
    if isinstance(errors, dict):
        for key, value in errors.items():
            if not value:
                continue
            if key == "non_field_errors":
                return first_error(value, path)
            step = f"[{key}]" if isinstance(key, int) else (f".{key}" if path else str(key))
            return first_error(value, path + step)
    if isinstance(errors, list):
        for index, item in enumerate(errors):
            if isinstance(item, dict | list):
                if item:
                    return first_error(item, f"{path}[{index}]")
            else:
                return path, str(item)
    return path, str(errors)
