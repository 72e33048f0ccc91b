"""Tools, tool choices and JSON formats as each surface sends them -> the engine's terms.

Every surface validates through these, so the bounds are one set (API-10): at most MAX_TOOLS
tools, each schema at most MAX_SCHEMA_BYTES of JSON and MAX_SCHEMA_DEPTH levels deep. Errors are
DRF ValidationErrors, which the surfaces turn into a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from rest_framework import serializers

from mlxhost.engine import TokenLogprob, Tool, ToolChoice

MAX_TOOLS = 64
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 24
MAX_DESCRIPTION = 32 * 1024  # coding agents describe their tools at length (Claude Code: 10k+)
MAX_TOP_LOGPROBS = 20
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def tool(name: Any, description: Any, parameters: Any) -> Tool:
    """One function tool, checked.

    Raises:
        ValidationError: a bad name, a description that is not text, or a schema that is not an
            object or is over the bounds.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise serializers.ValidationError("a tool name must be 1-64 letters, digits, '_', '-', '.' or ':'.")
    if description is not None and not isinstance(description, str):
        raise serializers.ValidationError(f"the description of {name!r} must be a string.")
    if len(description or "") > MAX_DESCRIPTION:
        raise serializers.ValidationError(
            f"the description of {name!r} is over {MAX_DESCRIPTION} characters."
        )
    return Tool(
        name, description or "", schema_text(parameters if parameters is not None else {"type": "object"})
    )


@dataclass(frozen=True, slots=True)
class ToolSet:
    """A request's tools as the model is offered them, the hosted tools left out (by type), and
    for namespaced functions, the offered name -> (namespace, name) the client knows them by."""

    tools: tuple[Tool, ...] = ()
    ignored: tuple[str, ...] = ()
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        """`X-Tools-Ignored` names the hosted tools this server left out of the prompt."""
        return {IGNORED_TOOLS_HEADER: ", ".join(self.ignored)} if self.ignored else {}


IGNORED_TOOLS_HEADER = "X-Tools-Ignored"


def tools_list(value: Any, *, parse: Any, schema_field: str = "") -> ToolSet:
    """A surface's tool list: `parse` reads one item into the tools it offers (none for a hosted
    tool, which it reports by raising `Hosted`). Offered names must be unique. Each tool's
    `param` is `tools[i]` + `schema_field` (`.function.parameters`), the field errors name.
    """
    if value is None:
        return ToolSet()
    if not isinstance(value, list):
        raise serializers.ValidationError("must be a list of tools.")
    if len(value) > MAX_TOOLS:
        raise serializers.ValidationError(f"at most {MAX_TOOLS} tools.")
    tools: list[Tool] = []
    ignored: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for index, item in enumerate(value):
        try:
            offered = parse(item)
        except Hosted as hosted:
            ignored.append(hosted.kind)
            continue
        for tool, origin in offered:
            tools.append(replace(tool, param=f"tools[{index}]{schema_field}"))
            if origin is not None:
                namespaced[tool.name] = origin
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise serializers.ValidationError("tool names must be unique.")
    if len(tools) > MAX_TOOLS:
        raise serializers.ValidationError(f"at most {MAX_TOOLS} tools.")
    return ToolSet(tuple(tools), tuple(ignored), namespaced)


class Hosted(Exception):
    """A tool the provider itself runs (web search, code execution): left out, and reported."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def schema_text(schema: Any) -> str:
    """A JSON schema as compact text, within the bounds.

    Raises:
        ValidationError: not an object, too large, or nested too deeply.
    """
    if not isinstance(schema, dict):
        raise serializers.ValidationError("a schema must be a JSON object.")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise serializers.ValidationError(f"a schema may nest at most {MAX_SCHEMA_DEPTH} levels.")
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise serializers.ValidationError(f"a schema may be at most {MAX_SCHEMA_BYTES} bytes of JSON.")
    return text


def openai_function(item: Any) -> list[tuple[Tool, None]]:
    """A chat completions tool: {"type": "function", "function": {name, description, parameters}}."""
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise serializers.ValidationError("only function tools are supported.")
    function = item.get("function")
    if not isinstance(function, dict):
        raise serializers.ValidationError("a function tool needs a 'function' object.")
    return [(tool(function.get("name"), function.get("description"), function.get("parameters")), None)]


def openai_tool_choice(value: Any, *, nested: bool = True) -> ToolChoice:
    """ "auto" | "none" | "required" | a named function ({"type": "function", "function": {"name"}}
    on chat, {"type": "function", "name"} on Responses)."""
    if value is None:
        return ToolChoice()
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        holder = value.get("function") if nested else value
        name = holder.get("name") if isinstance(holder, dict) else None
        if isinstance(name, str) and name:
            return ToolChoice("required", name)
    raise serializers.ValidationError("must be 'auto', 'none', 'required' or a named function.")


def openai_json_format(value: Any, *, nested: bool = True) -> str | None:
    """A response format -> the engine's `json_format`: None (text), "" (any JSON object) or a
    schema's text. Chat nests the schema under `json_schema`; Responses' `text.format` does not."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise serializers.ValidationError("must be an object with a 'type'.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        holder = value.get("json_schema") if nested else value
        if not isinstance(holder, dict) or "schema" not in holder:
            raise serializers.ValidationError("a json_schema format needs a 'schema'.")
        return schema_text(holder["schema"])
    raise serializers.ValidationError("type must be 'text', 'json_object' or 'json_schema'.")


def logprob_body(logprob: TokenLogprob) -> dict[str, Any]:
    """One token's logprobs in OpenAI's shape (chat and Responses)."""
    return {
        "token": logprob.token,
        "logprob": logprob.logprob,
        "bytes": list(logprob.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in logprob.top
        ],
    }


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest
