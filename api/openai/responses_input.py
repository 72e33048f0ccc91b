"""Input validation for POST /v1/responses: the body, and `input` normalised to role/content turns."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from api.openai.serializers import StrictBooleanField
from api.sampling import SamplingInput, max_tokens_field
from models_app.item_references import reference_turn

INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = {"input_text", "output_text", "text"}
MAX_METADATA_KEYS = 16
MAX_ITEM_ID_CHARS = 128
UNSUPPORTED = {
    "tools": "Tool calling is not supported by this server.",
    "tool_choice": "Tool calling is not supported by this server.",
    "background": "Background responses are not supported by this server.",
    "conversation": "Use previous_response_id to continue a conversation.",
    "reasoning": "Reasoning options are not supported by this server.",
}
# What OpenAI's `include` may name. All are accepted; none adds anything to an answer yet (no
# logprobs, reasoning, tool or image output exists here to include).
KNOWN_INCLUDES = (
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)


def _part_text(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
        text: str = part["text"]
        return text
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise serializers.ValidationError(f"Only text content is supported, not {kind!r}.")


def _reference(item: dict[str, Any]) -> dict[str, str]:
    item_id = item.get("id")
    if not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ITEM_ID_CHARS:
        raise serializers.ValidationError("An item_reference needs the string 'id' of a stored item.")
    return reference_turn(item_id)  # resolved under the lane permit, with the stored chain


def input_turns(value: Any) -> list[dict[str, str]]:
    """`input` as [{"role", "content"}]: a string is one user turn; items are messages with text,
    or references to stored items (placeholders that `item_references.turns_resolved` fills in).

    Raises:
        serializers.ValidationError: an item is not a text message.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise serializers.ValidationError("input must be a string or a non-empty list of message items.")
    turns = []
    for item in value:
        if isinstance(item, dict) and item.get("type") == "item_reference":
            turns.append(_reference(item))
            continue
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise serializers.ValidationError(f"Only message items are supported, not {kind!r}.")
        role = INPUT_ROLES.get(item.get("role", ""))
        if role is None:
            raise serializers.ValidationError(
                "A message's role must be user, assistant, system or developer."
            )
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(_part_text(part) for part in content)
        else:
            raise serializers.ValidationError("A message's content must be a string or a list of text parts.")
        turns.append({"role": role, "content": text})
    return turns


class TextConfigInput(serializers.Serializer[Any]):
    format = serializers.DictField(required=False)

    def validate_format(self, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "text") != "text":
            raise serializers.ValidationError("Only the text output format is supported.")
        return value


class ResponsesInput(SamplingInput):
    input = serializers.JSONField()
    instructions = serializers.CharField(
        required=False, allow_null=True, allow_blank=True, trim_whitespace=False
    )
    previous_response_id = serializers.CharField(required=False, allow_null=True, max_length=64)
    store = StrictBooleanField(required=False, default=True)
    stream = StrictBooleanField(required=False, default=False)
    max_output_tokens = max_tokens_field(source="max_tokens")
    metadata = serializers.DictField(
        child=serializers.CharField(max_length=512, allow_blank=True), required=False, allow_null=True
    )
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=1024)
    cache_salt = serializers.CharField(required=False, allow_null=True, max_length=1024)
    text = TextConfigInput(required=False, allow_null=True)
    truncation = serializers.ChoiceField(choices=["disabled"], required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    include = serializers.ListField(
        child=serializers.ChoiceField(choices=KNOWN_INCLUDES), required=False, allow_null=True, max_length=16
    )
    retention_s = serializers.IntegerField(
        required=False, allow_null=True, min_value=60, max_value=30 * 86400
    )
    # mlxhost extensions (send with the SDK's extra_body): the chat-completions sampling knobs,
    # less the penalties; `max_output_tokens` is Responses' name for `max_tokens`.
    max_tokens = None
    presence_penalty = None
    frequency_penalty = None

    def validate_input(self, value: Any) -> Any:
        input_turns(value)
        return value

    def validate_metadata(self, value: dict[str, str] | None) -> dict[str, str]:
        if value and len(value) > MAX_METADATA_KEYS:
            raise serializers.ValidationError(f"At most {MAX_METADATA_KEYS} metadata keys.")
        return value or {}

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, message in UNSUPPORTED.items():
            if self.initial_data.get(name):
                raise serializers.ValidationError({name: message})
        attrs["turns"] = input_turns(attrs["input"])
        attrs["include"] = attrs.get("include") or []
        return attrs
