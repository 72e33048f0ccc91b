"""Input validation for the OpenAI chat completions body (DRF serializers used for validation only)."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework import serializers

from api import images
from api import tools as tool_inputs
from api.fields import JsonInput, MetadataField
from api.sampling import MAX_STOP_SEQUENCES, SamplingInput
from mlxhost.engine import Message, ToolCall
from models_app.catalogue.specs import EFFORTS

ROLE_ALIASES = {"developer": "system"}
# As OpenAI: a predicted answer is text, and a turn with tools may answer with tool calls instead.
PREDICTION_WITH_TOOLS = "prediction cannot be used with tools: a predicted output must be the answer's text."
# Several choices (OpenAI `n`) run as rows of one batch; tools and predictions stay one choice.
CHOICES_WITH = "n > 1 cannot be used with {field}: only one choice per request then."

UNSUPPORTED_OPTIONS = {
    "functions": "The legacy 'functions' parameter is not supported; send 'tools'.",
    "function_call": "The legacy 'function_call' parameter is not supported; send 'tool_choice'.",
    "audio": "Audio output is not supported by this server.",
}


class MessageInput(JsonInput):
    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant", "tool"])
    content = serializers.JSONField(required=False, allow_null=True)
    name = serializers.CharField(required=False, max_length=64)
    tool_calls = serializers.JSONField(required=False, allow_null=True)
    tool_call_id = serializers.CharField(required=False, max_length=256)

    def validate_content(self, value: Any) -> tuple[str, tuple[Any, ...]]:
        """Its text, and its image parts, read with the message's place by `openai_images`."""
        return ("", ()) if value is None else images.openai_content(value)

    def validate_role(self, value: str) -> str:
        return ROLE_ALIASES.get(value, value)

    def validate_tool_calls(self, value: Any) -> tuple[ToolCall, ...]:
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
            raise serializers.ValidationError("must be a list of tool calls.")
        calls = []
        for call in value:
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise serializers.ValidationError("each tool call needs a function with a name.")
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            calls.append(ToolCall(str(call.get("id") or ""), function["name"], arguments))
        return tuple(calls)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        role = attrs["role"]
        if "content" not in attrs and not attrs.get("tool_calls"):
            raise serializers.ValidationError({"content": "This field is required."})
        if role == "tool" and not attrs.get("tool_call_id"):
            raise serializers.ValidationError(
                {"tool_call_id": "A tool message needs the id of the call it answers."}
            )
        text, attrs["image_urls"] = attrs.get("content") or ("", ())
        attrs["message"] = Message(
            role,
            text,
            tool_calls=attrs.get("tool_calls") or () if role == "assistant" else (),
            tool_call_id=attrs.get("tool_call_id") if role == "tool" else None,
            name=attrs.get("name") if role == "tool" else None,
        )
        return attrs


class StreamOptionsInput(JsonInput):
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


def choices_field() -> serializers.IntegerField:
    """OpenAI's `n`: how many choices, 1 up to `MLXHOST_MAX_CHOICES` (checked by `choices_count`)."""
    return serializers.IntegerField(required=False, allow_null=True, min_value=1)


def choices_count(value: int | None) -> int:
    """`n` as validated: None is 1; above `MLXHOST_MAX_CHOICES` it is refused."""
    limit = settings.MLXHOST_MAX_CHOICES
    if value is not None and value > limit:
        raise serializers.ValidationError(f"must be at most {limit} on this server.")
    return value or 1


class ChatCompletionInput(TextSamplingInput):
    messages = MessageInput(many=True, allow_empty=False)
    stream = StrictBooleanField(required=False, default=False)
    stream_options = StreamOptionsInput(required=False, allow_null=True)
    max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    n = choices_field()
    logprobs = StrictBooleanField(required=False, allow_null=True)
    top_logprobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=tool_inputs.MAX_TOP_LOGPROBS
    )
    tools = serializers.JSONField(required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)
    parallel_tool_calls = StrictBooleanField(required=False, allow_null=True)
    response_format = serializers.JSONField(required=False, allow_null=True)
    reasoning_effort = serializers.ChoiceField(choices=list(EFFORTS), required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    # OpenAI's bounds hold, though a chat completion is not stored here and its metadata is unused.
    metadata = MetadataField(required=False, allow_null=True)
    # Warm-session scoping (SES-2/3): only HMAC fingerprints of these are kept.
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=1024)
    cache_salt = serializers.CharField(required=False, allow_null=True, max_length=1024)
    # OpenAI Predicted Outputs: the answer's expected text, drafted from (docs/speculation.md).
    prediction = serializers.JSONField(required=False, allow_null=True)

    def validate_prediction(self, value: Any) -> str | None:
        return prediction_text(value)

    def validate_n(self, value: int | None) -> int:
        return choices_count(value)

    def validate_tools(self, value: Any) -> tool_inputs.ToolSet:
        return tool_inputs.tools_list(
            value, parse=tool_inputs.openai_function, schema_field=".function.parameters"
        )

    def validate_tool_choice(self, value: Any) -> Any:
        return tool_inputs.openai_tool_choice(value)

    def validate_response_format(self, value: Any) -> str | None:
        return tool_inputs.openai_json_format(value)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, message in UNSUPPORTED_OPTIONS.items():
            if self.initial_data.get(name):
                raise serializers.ValidationError({name: message})
        attrs["max_tokens"] = attrs.get("max_completion_tokens") or attrs.get("max_tokens")
        if attrs.get("prediction") is not None and self.initial_data.get("tools"):
            raise serializers.ValidationError({"prediction": PREDICTION_WITH_TOOLS})
        attrs["n"] = attrs.get("n") or 1
        for name in ("tools", "prediction"):
            if attrs["n"] > 1 and self.initial_data.get(name):
                raise serializers.ValidationError({"n": CHOICES_WITH.format(field=name)})
        if attrs.get("top_logprobs") is not None and not attrs.get("logprobs"):
            raise serializers.ValidationError({"top_logprobs": "needs logprobs set to true."})
        attrs["logprobs"] = (attrs.get("top_logprobs") or 0) if attrs.get("logprobs") else None
        # Images (docs/api.md#images): read and bounded here, where each message's place is known;
        # an InvalidImageError leaves DRF as it is, a 400 with code `invalid_image`.
        items = attrs["messages"]
        read = images.openai_images([m["message"] for m in items], [m["image_urls"] for m in items])
        for item, with_images in zip(items, read, strict=True):
            item["message"] = with_images
        return attrs


PREDICTION_SHAPE = (
    'prediction must be {"type": "content", "content": TEXT}, where TEXT is a string or a list of '
    '{"type": "text", "text": STRING} parts.'
)


def prediction_text(value: Any) -> str | None:
    """The text of an OpenAI `prediction` (`{"type": "content", "content": ...}`), None for none.

    Raises:
        serializers.ValidationError: any other shape.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) != {"type", "content"}:
        raise serializers.ValidationError(PREDICTION_SHAPE)
    content = value["content"]
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
        isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
        and set(part) == {"type", "text"}
        for part in content
    ):
        raise serializers.ValidationError(PREDICTION_SHAPE)
    return "".join(part["text"] for part in content)


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
