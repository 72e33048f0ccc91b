"""Input validation for Anthropic Messages bodies (DRF serializers used for validation only)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from api.openai.serializers import StrictBooleanField
from api.sampling import SamplingInput, optional_float, stop_list_field

MAX_STOP_SEQUENCES = 16
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for `thinking.budget_tokens`
# Text blocks are joined with a blank line, and so are consecutive turns of one role,
# which Anthropic's API combines into a single turn.
BLOCK_SEPARATOR = "\n\n"
UNSUPPORTED_BLOCK = "Content blocks of type {kind!r} are not supported by this server; send text blocks."
STRUCTURED_OUTPUT_UNSUPPORTED = "Structured outputs (output_config.format) are not supported by this server."
# Option -> (the `type`s that mean "off", message). Any other non-empty value is a 400.
UNSUPPORTED_OPTIONS: dict[str, tuple[frozenset[str], str]] = {
    "tools": (frozenset(), "Tool use is not supported by this server."),
    "tool_choice": (frozenset({"auto", "none"}), "Forcing tool use is not supported by this server."),
    "mcp_servers": (frozenset(), "MCP servers are not supported by this server."),
    "container": (frozenset(), "Containers are not supported by this server."),
}


def blocks_text(value: Any) -> str:
    """A string, or a list of `{"type": "text", "text": ...}` blocks, as one text.

    Raises:
        serializers.ValidationError: another block type, or a malformed block.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise serializers.ValidationError("Must be a string or a list of text blocks.")
    texts = []
    for block in value:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise serializers.ValidationError("Each content block must be an object with a 'type'.")
        if block["type"] != "text":
            raise serializers.ValidationError(UNSUPPORTED_BLOCK.format(kind=block["type"]))
        if not isinstance(block.get("text"), str):
            raise serializers.ValidationError("A text block needs a string 'text'.")
        texts.append(block["text"])  # cache_control and citations are accepted and ignored
    return BLOCK_SEPARATOR.join(texts)


class MessageInput(serializers.Serializer[Any]):
    role = serializers.ChoiceField(choices=["user", "assistant"])
    content = serializers.JSONField()

    class Meta:
        ref_name = "AnthropicMessageInput"  # its OpenAPI component; OpenAI's MessageInput is another

    def validate_content(self, value: Any) -> str:
        return blocks_text(value)


class ThinkingInput(serializers.Serializer[Any]):
    """Extended thinking, validated as Anthropic does and accepted; for now it changes nothing:
    the model answers as it would without it, and no `thinking` block is sent."""

    type = serializers.ChoiceField(choices=["enabled", "disabled", "adaptive"])
    budget_tokens = serializers.IntegerField(required=False, min_value=MIN_THINKING_BUDGET)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["type"] == "enabled" and "budget_tokens" not in attrs:
            raise serializers.ValidationError({"budget_tokens": "Required when thinking is enabled."})
        return attrs


class MetadataInput(serializers.Serializer[Any]):
    user_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=256)


class PromptInput(serializers.Serializer[Any]):
    """What both /v1/messages and /v1/messages/count_tokens take: the model and the prompt."""

    model = serializers.CharField(max_length=64)
    messages = MessageInput(many=True, allow_empty=False)
    system = serializers.JSONField(required=False, allow_null=True)

    output_config = serializers.DictField(required=False, allow_null=True)  # `effort` is ignored
    thinking = ThinkingInput(required=False, allow_null=True)

    def validate_output_config(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("format"):
            raise serializers.ValidationError(STRUCTURED_OUTPUT_UNSUPPORTED)
        return value

    def validate_system(self, value: Any) -> str:
        return "" if value is None else blocks_text(value)

    def validate_messages(self, value: list[dict[str, str]]) -> list[dict[str, str]]:
        merged: list[dict[str, str]] = []
        for message in value:
            if merged and merged[-1]["role"] == message["role"]:
                merged[-1]["content"] += BLOCK_SEPARATOR + message["content"]
            else:
                merged.append(dict(message))
        return merged

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, (off, message) in UNSUPPORTED_OPTIONS.items():
            value = self.initial_data.get(name)
            if value and not (isinstance(value, dict) and value.get("type") in off):
                raise serializers.ValidationError({name: message})
        attrs.setdefault("system", "")
        return attrs


class MessagesInput(PromptInput, SamplingInput):
    """POST /v1/messages. Sampling ranges follow Anthropic's API (temperature 0..1)."""

    max_tokens = serializers.IntegerField(min_value=1)
    stop_sequences = stop_list_field(MAX_STOP_SEQUENCES, source="stop")
    temperature = optional_float(0.0, 1.0)
    metadata = MetadataInput(required=False, allow_null=True)
    stream = StrictBooleanField(required=False, default=False)
    service_tier = serializers.CharField(required=False, allow_null=True)  # accepted, ignored
    # Not Anthropic parameters: the wire names stay unknown (ignored), as Anthropic's API has them.
    stop = None
    min_p = None
    repetition_penalty = None
    presence_penalty = None
    frequency_penalty = None
    seed = None
    logit_bias = None

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        budget = (attrs.get("thinking") or {}).get("budget_tokens")
        if budget is not None and budget >= attrs["max_tokens"]:
            raise serializers.ValidationError({"thinking": "budget_tokens must be less than max_tokens."})
        return attrs


class CountTokensInput(PromptInput):
    """POST /v1/messages/count_tokens."""
