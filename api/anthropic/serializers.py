"""Input validation for Anthropic Messages bodies (DRF serializers used for validation only)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from rest_framework import serializers

from api import images
from api import tools as tool_inputs
from api.fields import JsonInput
from api.openai.serializers import StrictBooleanField
from api.sampling import SamplingInput, optional_float, stop_list_field
from mlxhost.engine import InvalidImageError, Message, Tool, ToolCall, ToolChoice
from models_app.catalogue.specs import EFFORTS
from models_app.turns import images as image_limits

MAX_STOP_SEQUENCES = 16
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for `thinking.budget_tokens`
# Text blocks are joined with a blank line, and so are consecutive turns of one role,
# which Anthropic's API combines into a single turn.
BLOCK_SEPARATOR = "\n\n"
UNSUPPORTED_BLOCK = "Content blocks of type {kind!r} are not supported by this server; send text blocks."
# Blocks of an assistant's earlier thinking: accepted and left out (never replayed to the model).
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# Option -> (the `type`s that mean "off", message). Any other non-empty value is a 400.
UNSUPPORTED_OPTIONS: dict[str, tuple[frozenset[str], str]] = {
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


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content", "")
    text = content if isinstance(content, str) else blocks_text(content)
    return f"Error: {text}" if block.get("is_error") else text


def turn_messages(role: str, value: Any) -> list[Message]:
    """One Anthropic turn as engine messages: its text, an assistant's `tool_use` blocks as its
    calls, and a user's `tool_result` blocks as "tool" messages (before the user's own text).

    Raises:
        serializers.ValidationError: an unsupported or malformed block.
    """
    if isinstance(value, str):
        return [Message(role, value)]  # type: ignore[arg-type]  # role is "user", "assistant" or "system"
    if not isinstance(value, list):
        raise serializers.ValidationError("Must be a string or a list of content blocks.")
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for block in value:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in SKIPPED_BLOCKS:
            continue
        if kind == "image":  # read by `PromptInput.validate_messages`, which knows the turn's place
            continue
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise serializers.ValidationError("A tool_use block needs a string 'id' and 'name'.")
            calls.append(ToolCall(block["id"], block["name"], json.dumps(block.get("input") or {})))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise serializers.ValidationError("A tool_result block needs the 'tool_use_id' it answers.")
            results.append(Message("tool", _result_text(block), tool_call_id=block["tool_use_id"]))
        else:
            texts.append(blocks_text([block]))
    text = BLOCK_SEPARATOR.join(texts)
    if role == "assistant":
        return [Message("assistant", text, tool_calls=tuple(calls))]
    if role == "system":
        return [Message("system", text)]
    return results + ([Message("user", text)] if text or not results else [])


def with_images(turn: list[Message], index: int, blocks: list[tuple[int, Any]], limits: Any) -> list[Message]:
    """`turn` (message `index`'s) with its `image` blocks read into its user message.

    Raises:
        InvalidImageError: an unreadable block, or images outside a user turn.
    """
    params = [f"messages[{index}].content[{part}].source" for part, _ in blocks]
    if not blocks:
        return turn
    if turn[-1].role != "user":
        raise InvalidImageError(params[0], "only user turns may hold images.")
    read = tuple(
        images.anthropic_image(block, param, limits) for param, (_, block) in zip(params, blocks, strict=True)
    )
    return [*turn[:-1], replace(turn[-1], images=read)]


# Anthropic-defined tools (versioned types such as web_search_20250305 or bash_20250124): run by
# Anthropic or defined by it, with no schema here; left out and named in X-Tools-Ignored.
ANTHROPIC_DEFINED = ("web_search_", "web_fetch_", "code_execution_", "bash_", "text_editor_", "computer_",
                     "memory_", "tool_search_")  # fmt: skip


def anthropic_tool(item: Any) -> list[tuple[Tool, None]]:
    """A client tool: {name, description, input_schema} ("custom", the default type).

    Raises:
        tool_inputs.Hosted: an Anthropic-defined tool (left out, reported).
    """
    kind = item.get("type", "custom") if isinstance(item, dict) else type(item).__name__
    if isinstance(kind, str) and kind.startswith(ANTHROPIC_DEFINED):
        raise tool_inputs.Hosted(kind)
    if kind != "custom":
        raise serializers.ValidationError(f"Only client (custom) tools are supported, not {kind!r}.")
    if not isinstance(item.get("input_schema"), dict):
        raise serializers.ValidationError(f"The tool {item.get('name')!r} needs an 'input_schema' object.")
    return [(tool_inputs.tool(item.get("name"), item.get("description"), item["input_schema"]), None)]


def anthropic_tool_choice(value: Any) -> ToolChoice:
    """{"type": "auto" | "any" | "none"} or {"type": "tool", "name"}."""
    if value is None:
        return ToolChoice()
    kind = value.get("type") if isinstance(value, dict) else None
    single = bool(value.get("disable_parallel_tool_use")) if isinstance(value, dict) else False
    if kind in ("auto", "none"):
        return ToolChoice(kind, single=single)
    if kind == "any":
        return ToolChoice("required", single=single)
    if kind == "tool" and isinstance(value.get("name"), str) and value["name"]:
        return ToolChoice("required", value["name"], single=single)
    raise serializers.ValidationError("type must be 'auto', 'any', 'none', or 'tool' with a name.")


def json_format_of(value: Any) -> str | None:
    """Anthropic structured output ({"type": "json_schema", "schema"}) as the engine's `json_format`."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema" or "schema" not in value:
        raise serializers.ValidationError("format must be {'type': 'json_schema', 'schema': {...}}.")
    return tool_inputs.schema_text(value["schema"])


class MessageInput(JsonInput):
    # "system" mid-conversation: Claude Code's reminders (the mid-conversation-system beta).
    role = serializers.ChoiceField(choices=["user", "assistant", "system"])
    content = serializers.JSONField()

    class Meta:
        ref_name = "AnthropicMessageInput"  # its OpenAPI component; OpenAI's MessageInput is another

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            attrs["turn"] = turn_messages(attrs["role"], attrs["content"])
        except serializers.ValidationError as exc:
            raise serializers.ValidationError({"content": exc.detail}) from None
        content = attrs["content"]
        attrs["image_blocks"] = [
            (index, block)
            for index, block in enumerate(content if isinstance(content, list) else [])
            if isinstance(block, dict) and block.get("type") == "image"
        ]
        return attrs


class ThinkingInput(JsonInput):
    """Extended thinking, validated as Anthropic does: `enabled` or `adaptive` turns the chat
    template's thinking on and sends the model's reasoning as `thinking` blocks; `disabled` turns it
    off. On a model without thinking markers it changes nothing. `budget_tokens` is not enforced."""

    type = serializers.ChoiceField(choices=["enabled", "disabled", "adaptive"])
    budget_tokens = serializers.IntegerField(required=False, min_value=MIN_THINKING_BUDGET)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["type"] == "enabled" and "budget_tokens" not in attrs:
            raise serializers.ValidationError({"budget_tokens": "Required when thinking is enabled."})
        return attrs


class OutputConfigInput(JsonInput):
    """`output_config`: the reasoning effort (API-9) and the structured-output format."""

    effort = serializers.ChoiceField(choices=list(EFFORTS), required=False, allow_null=True)
    format = serializers.JSONField(required=False, allow_null=True)

    def validate_format(self, value: Any) -> Any:
        json_format_of(value)  # checked here; `PromptInput.validate` reads it
        return value


class MetadataInput(JsonInput):
    user_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=256)


def _joinable(earlier: list[Message], later: list[Message]) -> bool:
    # Text and calls of one role join; "tool" results stay their own messages.
    return earlier[-1].role != "tool" and later[0].role != "tool" and not earlier[-1].tool_calls


class PromptInput(JsonInput):
    """What both /v1/messages and /v1/messages/count_tokens take: the model and the prompt."""

    model = serializers.CharField(max_length=64)
    messages = MessageInput(many=True, allow_empty=False)
    system = serializers.JSONField(required=False, allow_null=True)

    output_config = OutputConfigInput(required=False, allow_null=True)
    output_format = serializers.JSONField(required=False, allow_null=True)  # the structured-outputs beta
    thinking = ThinkingInput(required=False, allow_null=True)
    tools = serializers.JSONField(required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)

    def validate_output_format(self, value: Any) -> str | None:
        return json_format_of(value)

    def validate_tools(self, value: Any) -> tool_inputs.ToolSet:
        return tool_inputs.tools_list(value, parse=anthropic_tool, schema_field=".input_schema")

    def validate_tool_choice(self, value: Any) -> ToolChoice:
        return anthropic_tool_choice(value)

    def validate_system(self, value: Any) -> str:
        return "" if value is None else blocks_text(value)

    def validate_messages(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Consecutive turns of one role are one turn, as Anthropic's API combines them.
        merged: list[dict[str, Any]] = []
        limits = image_limits.limits()
        images.count_images([len(m["image_blocks"]) for m in value], limits, "content", ".source")
        for index, message in enumerate(value):
            turn = with_images(message["turn"], index, message["image_blocks"], limits)
            last = merged[-1] if merged else None
            if last is not None and last["role"] == message["role"] and _joinable(last["turn"], turn):
                head = last["turn"][-1]
                text = BLOCK_SEPARATOR.join(t for t in (head.content, turn[0].content) if t)
                last["turn"][-1] = Message(
                    head.role,
                    text,
                    tool_calls=head.tool_calls + turn[0].tool_calls,
                    images=head.images + turn[0].images,
                )
                last["turn"] += turn[1:]
            else:
                merged.append({"role": message["role"], "turn": list(turn)})
        images.bound_images([m for item in merged for m in item["turn"]], limits)
        return merged

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, (off, message) in UNSUPPORTED_OPTIONS.items():
            value = self.initial_data.get(name)
            if value and not (isinstance(value, dict) and value.get("type") in off):
                raise serializers.ValidationError({name: message})
        attrs.setdefault("system", "")
        config_format = (attrs.get("output_config") or {}).get("format")
        attrs["json_format"] = (
            json_format_of(config_format) if config_format is not None else attrs.get("output_format")
        )
        kind = (attrs.get("thinking") or {}).get("type")
        attrs["thinking_enabled"] = kind in ("enabled", "adaptive")
        # Adaptive thinking leaves the switch to the effort, when one is given.
        attrs["effort"] = (attrs.get("output_config") or {}).get("effort")
        open_ = kind is None or (kind == "adaptive" and attrs["effort"] is not None)
        attrs["thinking_switch"] = None if open_ else attrs["thinking_enabled"]
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
