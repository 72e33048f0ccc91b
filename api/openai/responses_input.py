"""Input validation for POST /v1/responses: the body, and `input` normalised to role/content turns."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rest_framework import serializers

from api import images
from api import tools as tool_inputs
from api.fields import JsonInput, MetadataField
from api.openai.serializers import StrictBooleanField
from api.sampling import SamplingInput, max_tokens_field, sampling_overrides
from mlxhost.engine import Image, InvalidImageError, ToolChoice
from models_app.catalogue.specs import EFFORTS
from models_app.turns import images as image_limits
from models_app.turns.conversations import namespaced_name
from models_app.turns.item_references import reference_turn
from models_app.turns.response_request import ResponseRequest

if TYPE_CHECKING:
    from mlxhost.engine import Tool

INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = {"input_text", "output_text", "text"}
MAX_ITEM_ID_CHARS = 128
UNSUPPORTED = {
    "background": "Background responses are not supported by this server.",
    "conversation": "Use previous_response_id to continue a conversation.",
}
# The engine's field names, as Responses spells them (`api.auth.in_wire_names`).
ENGINE_NAMES = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ECHOED = ("tools", "tool_choice", "text", "parallel_tool_calls")  # as sent, in the response object
# What OpenAI's `include` may name. All are accepted; only the logprobs add to an answer (no
# hosted tool or image output exists here to include).
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


def _kind(item: Any, default: str) -> str:
    """An item's `type` (a string, as sets are looked up by it), or the name of what came instead."""
    kind = item.get("type", default) if isinstance(item, dict) else None
    return kind if isinstance(kind, str) else type(kind if isinstance(item, dict) else item).__name__


def _part_text(part: Any) -> str:
    if _kind(part, "") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
        text: str = part["text"]
        return text
    kind = _kind(part, "")
    raise serializers.ValidationError(f"Only text content is supported, not {kind!r}.")


def _reference(item: dict[str, Any]) -> dict[str, str]:
    item_id = item.get("id")
    if not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ITEM_ID_CHARS:
        raise serializers.ValidationError("An item_reference needs the string 'id' of a stored item.")
    return reference_turn(item_id)  # resolved under the lane permit, with the stored chain


def _call(item: dict[str, Any], turns: list[dict[str, Any]]) -> None:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(arguments, str)):
        raise serializers.ValidationError(
            "A function_call item needs string 'call_id', 'name' and 'arguments'."
        )
    namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
    call = {"id": call_id, "name": namespaced_name(namespace, name), "arguments": arguments}
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
        last.setdefault("tool_calls", []).append(call)
    else:
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict[str, Any]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise serializers.ValidationError(
            "A function_call_output item needs the string 'call_id' it answers."
        )
    if isinstance(output, list):
        output = "".join(_part_text(part) for part in output)
    if not isinstance(output, str):
        raise serializers.ValidationError("A function_call_output's 'output' must be a string or text parts.")
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def input_turns(value: Any) -> list[dict[str, Any]]:
    """`input` as [{"role", "content"}]: a string is one user turn; items are messages with text,
    function calls (an assistant turn's `tool_calls`) and their outputs ("tool" turns), or
    references to stored items (placeholders that `item_references.turns_resolved` fills in).
    Reasoning items are accepted and left out: the model's earlier thinking is not replayed.

    Raises:
        serializers.ValidationError: an item of another kind, or a malformed one.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise serializers.ValidationError("input must be a string or a non-empty list of message items.")
    turns: list[dict[str, Any]] = []
    read: list[Image] = []  # the request's images, in order
    for position, item in enumerate(value):
        kind = _kind(item, "message")
        if kind == "item_reference":
            turns.append(_reference(item))
            continue
        if kind == "function_call":
            _call(item, turns)
            continue
        if kind == "function_call_output":
            turns.append(_call_output(item))
            continue
        if kind == "reasoning":
            continue
        if kind != "message":
            raise serializers.ValidationError(
                f"Only message, function_call, function_call_output and item_reference items are supported, not {kind!r}."
            )
        role = item.get("role")
        role = INPUT_ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise serializers.ValidationError(
                "A message's role must be user, assistant, system or developer."
            )
        content = item.get("content")
        turn: dict[str, Any]
        if isinstance(content, str):
            turn = {"role": role, "content": content}
        elif isinstance(content, list):
            turn = _message_parts(content, role, f"input[{position}]", read)
        else:
            raise serializers.ValidationError("A message's content must be a string or a list of text parts.")
        turns.append(turn)
    images.bound_read(read, image_limits.limits())
    return turns


def _message_parts(content: list[Any], role: str, place: str, read: list[Image]) -> dict[str, Any]:
    """A message item's parts as one turn: its text parts joined, and its `input_image` parts
    (base64 data URLs, read and checked here, appended to `read`, the request's images so far) as
    `images` in their stored form (api/images.py).

    Raises:
        serializers.ValidationError: a part of another kind.
        InvalidImageError: an unreadable or remote image, a `file_id`, an image outside a user
            turn, or one past `max_images` (refused before it is read).
    """
    limits = image_limits.limits()
    texts: list[str] = []
    mine: list[Image] = []
    for index, part in enumerate(content):
        if _kind(part, "") != "input_image":
            texts.append(_part_text(part))
            continue
        param = f"{place}.content[{index}].image_url"
        if role != "user":
            raise InvalidImageError(param, "only user messages may hold images.")
        if part.get("image_url") is None and part.get("file_id") is not None:
            raise InvalidImageError(
                f"{place}.content[{index}].file_id",
                "files are not stored by this server; send the image as image_url, a base64 data URL.",
            )
        if len(read) >= limits.max_images:
            raise InvalidImageError(param, f"a request may hold at most {limits.max_images} images.")
        image = images.image_from_url(part.get("image_url"), param, limits)
        read.append(image)
        mine.append(image)
    turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
    if mine:
        turn["images"] = [images.stored_form(image) for image in mine]
    return turn


class TextConfigInput(JsonInput):
    format = serializers.DictField(required=False)
    verbosity = serializers.CharField(required=False, allow_null=True)  # accepted, ignored

    def validate_format(self, value: dict[str, Any]) -> dict[str, Any]:
        tool_inputs.openai_json_format(value, nested=False)  # checked here; read in `validate`
        return value


# Tools OpenAI runs itself: this server cannot, so they are left out of the prompt and named in
# the X-Tools-Ignored header (Codex sends web_search with every request).
HOSTED_TOOLS = frozenset(
    {"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation", "mcp",
     "computer_use_preview"}
)  # fmt: skip


def response_tool(item: Any) -> list[tuple[Tool, tuple[str, str] | None]]:
    """A Responses tool as the functions it offers: a function tool, or each function of a
    `namespace` tool under `namespace__name` (calls go back with the two apart, as Codex expects).

    Raises:
        tool_inputs.Hosted: a tool OpenAI runs itself (left out, reported).
    """
    kind = _kind(item, "function")
    if kind in HOSTED_TOOLS:
        raise tool_inputs.Hosted(kind)
    if kind == "namespace" and isinstance(item.get("name"), str) and isinstance(item.get("tools"), list):
        namespace = item["name"]
        offered: list[tuple[Tool, tuple[str, str] | None]] = []
        for function in item["tools"]:
            if not isinstance(function, dict) or function.get("type", "function") != "function":
                raise serializers.ValidationError(f"A namespace's tools must be functions ({namespace!r}).")
            name = namespaced_name(namespace, str(function.get("name")))
            tool = tool_inputs.tool(name, function.get("description"), function.get("parameters"))
            offered.append((tool, (namespace, str(function.get("name")))))
        return offered
    if kind != "function":
        raise serializers.ValidationError(f"Only function and namespace tools are supported, not {kind!r}.")
    return [(tool_inputs.tool(item.get("name"), item.get("description"), item.get("parameters")), None)]


class ReasoningInput(JsonInput):
    """`reasoning`: its effort reaches the chat template (API-9); no summary is ever written."""

    effort = serializers.ChoiceField(choices=list(EFFORTS), required=False, allow_null=True)
    summary = serializers.CharField(required=False, allow_null=True, allow_blank=True)  # ignored


class ResponsesInput(SamplingInput):
    input = serializers.JSONField()
    instructions = serializers.CharField(
        required=False, allow_null=True, allow_blank=True, trim_whitespace=False
    )
    previous_response_id = serializers.CharField(required=False, allow_null=True, max_length=64)
    store = StrictBooleanField(required=False, default=True)
    stream = StrictBooleanField(required=False, default=False)
    max_output_tokens = max_tokens_field(source="max_tokens")
    metadata = MetadataField(required=False, allow_null=True)
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=1024)
    cache_salt = serializers.CharField(required=False, allow_null=True, max_length=1024)
    text = TextConfigInput(required=False, allow_null=True)
    truncation = serializers.ChoiceField(choices=["disabled"], required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    include = serializers.ListField(
        child=serializers.ChoiceField(choices=KNOWN_INCLUDES), required=False, allow_null=True, max_length=16
    )
    tools = serializers.JSONField(required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)
    top_logprobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=tool_inputs.MAX_TOP_LOGPROBS
    )
    reasoning = ReasoningInput(required=False, allow_null=True)
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

    def validate_tools(self, value: Any) -> tool_inputs.ToolSet:
        return tool_inputs.tools_list(value, parse=response_tool, schema_field=".parameters")

    def validate_tool_choice(self, value: Any) -> Any:
        return tool_inputs.openai_tool_choice(value, nested=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, message in UNSUPPORTED.items():
            if self.initial_data.get(name):
                raise serializers.ValidationError({name: message})
        attrs["turns"] = input_turns(attrs["input"])
        attrs["json_format"] = tool_inputs.openai_json_format(
            (attrs.get("text") or {}).get("format"), nested=False
        )
        wants_logprobs = LOGPROBS_INCLUDE in (attrs.get("include") or ())
        attrs["logprobs"] = (attrs.get("top_logprobs") or 0) if wants_logprobs else None
        attrs["include"] = attrs.get("include") or []
        attrs["echo"] = {name: self.initial_data.get(name) for name in ECHOED}
        return attrs


def response_request(data: dict[str, Any]) -> ResponseRequest:
    """The Responses use case's input from a body `ResponsesInput` validated."""
    tools: tool_inputs.ToolSet | None = data.get("tools")
    choice: ToolChoice = data.get("tool_choice") or ToolChoice()
    return ResponseRequest(
        model=data["model"],
        turns=tuple(data["turns"]),
        sampling=sampling_overrides(data),
        instructions=data.get("instructions"),
        previous_response_id=data.get("previous_response_id"),
        store=data["store"],
        metadata=data.get("metadata") or {},
        max_output_tokens=data.get("max_tokens"),
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        retention_s=data.get("retention_s"),
        cache_salt=data.get("cache_salt"),
        prompt_cache_key=data.get("prompt_cache_key"),
        effort=(data.get("reasoning") or {}).get("effort"),
        tools=tools.tools if tools else (),
        namespaced=tools.namespaced if tools else {},
        tool_choice=replace(choice, single=data.get("parallel_tool_calls") is False),
        json_format=data.get("json_format"),
    )
