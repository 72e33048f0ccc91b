"""What an answer must look like: tools, forced calls and JSON formats, as one `AnswerPlan`.

Pure functions of the request and of whether the model has its own tool format. The plan says
how the prompt offers the tools, which grammar (if any) constrains decoding, and how the text
that comes out is read back (answer.py).

- A model whose chat template knows tools (mlx-lm's tokenizer wrapper says so) gets them through
  its template, and its calls are read with its own mlx-lm parser ("native").
- A model without tool support gets them in a system note, and `tool_choice=auto` is decoded
  under a grammar that allows either an answer that does not start with `{`, or one JSON call
  object that matches a tool's schema ("choice"): never a broken call.
- A forced call (`required`, or a named function) is decoded under the tool's schema on any
  model: the output is the named function's arguments ("args"), or a `{"name", "arguments"}`
  object when several tools may be called ("call").
- A JSON answer (`json_format`) is decoded under its schema, or any JSON object ("json").
- Tools and a JSON answer together (an agent with a typed result): with `auto`, one grammar
  allows either a call or the JSON answer. A model whose tool format is a JSON call between
  markers gets its markers ("native"); any other model writes `<tool_call>` before the call
  object ("choice"), so neither branch can be read as the other. A forced call is constrained
  as without a format, and the format applies on the turn after the tool results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from mlxhost.engine.errors import InvalidRequestError
from mlxhost.engine.types import Grammar, Message, Tool

if TYPE_CHECKING:
    from mlxhost.engine.types import GenerationRequest

Mode = Literal["text", "json", "args", "call", "choice", "native"]
ANY_OBJECT = '{"type": "object"}'
# How llguidance reads a tool's schema: compact JSON, and keywords it cannot enforce (Claude Code's
# schemas use `propertyNames`) are skipped rather than refused: the tools are the client's, and a
# call that follows the rest of the schema beats a failed request. JSON formats stay strict.
TOOL_GUIDANCE = {"whitespace_flexible": False, "lenient": True}
TOOL_NOTE = (
    "You can call functions. To call one, answer with only a JSON object of the form "
    '{"name": <function name>, "arguments": <its arguments as an object>} and nothing else. '
    "Otherwise, answer normally.\n\nFunctions:\n"
)
# With a JSON answer format the call is marked, so that it cannot be read as the answer.
CALL_MARK = "<tool_call>"
MARKED_TOOL_NOTE = (
    f"You can call functions. To call one, answer with only {CALL_MARK} followed by a JSON object "
    'of the form {"name": <function name>, "arguments": <its arguments as an object>}. '
    "Otherwise, answer with only your final answer as JSON.\n\nFunctions:\n"
)
# The answer's JSON inside a Lark grammar, compact as `JSON_OPTIONS` makes a JSON format.
ANSWER_GUIDANCE = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    mode: Mode = "text"
    grammar: Grammar | None = None
    tools: tuple[Tool, ...] = ()  # the functions a call may name
    offer_natively: bool = False  # pass `tools` to the chat template
    forced: str | None = None  # "args": the function every answer calls
    single: bool = False  # at most one call: later ones are dropped
    call_prefix: str = ""  # written before a call object (CALL_MARK beside a format; else none)
    param: str = "response_format"  # the request field an error in `grammar` names...
    # ...unless one of these parts (each a grammar alone, with its field) is to blame.
    parts: tuple[tuple[Grammar, str], ...] = ()
    # The answer may be plain text (no grammar, or tools-only `auto`): only then do text stop
    # strings end it. An answer that is all JSON (a format, a forced call) ends where its
    # grammar does, so a stop string can never cut it into invalid JSON (API-7).
    free_text: bool = True


def plan_answer(
    request: GenerationRequest, *, native_tools: bool, tool_markers: tuple[str, str] | None = None
) -> AnswerPlan:
    """The plan for `request` on a model that does (or does not) know tools in its template.

    `tool_markers` are the model's call markers as Lark terms, when its calls are JSON objects
    between them (mlx-lm's json_tools format); only then can a grammar keep its own format.

    Raises:
        InvalidRequestError: a forced function that is not among the tools, or a forced call
            without tools.
    """
    plan = _plan(request, native_tools=native_tools, markers=tool_markers)
    return replace(plan, single=request.tool_choice.single) if plan.tools else plan


def _plan(request: GenerationRequest, *, native_tools: bool, markers: tuple[str, str] | None) -> AnswerPlan:
    choice, tools = request.tool_choice, request.tools
    if not tools and (choice.mode == "required" or choice.name is not None):
        raise InvalidRequestError("tool_choice", "asks for a tool call, but the request has no tools.")
    if choice.mode == "none":
        tools = ()
    by_name = {tool.name: tool for tool in tools}
    if choice.name is not None and choice.name not in by_name:
        raise InvalidRequestError("tool_choice", f"names {choice.name!r}, which is not among the tools.")
    if request.json_format is None:
        return _tools_plan(tools, choice.name, choice.mode, native_tools)
    answer = Grammar("json", request.json_format or ANY_OBJECT)
    if not tools:
        return AnswerPlan("json", answer, param=request.format_param, free_text=False)
    prefix = "" if native_tools else CALL_MARK  # the prompt's note and past calls say it too
    parts = ((answer, request.format_param), *_tool_parts(tools))
    forced = choice.mode == "required" or choice.name is not None
    if forced and request.messages and request.messages[-1].role == "tool":
        # The call was made and answered: this turn gives the typed answer.
        return AnswerPlan(
            "json",
            answer,
            tools,
            native_tools,
            call_prefix=prefix,
            param=request.format_param,
            free_text=False,
        )
    if forced:
        return replace(_tools_plan(tools, choice.name, choice.mode, native_tools), call_prefix=prefix)
    if native_tools and markers is not None:
        grammar = Grammar("lark", _native_choice_grammar(tools, answer, markers, request.tool_choice.single))
        return AnswerPlan("native", grammar, tools, True, param="tools", parts=parts, free_text=False)
    # A native format a grammar cannot write (not JSON between markers): the note's format.
    grammar = Grammar("lark", _marked_choice_grammar(tools, answer))
    return AnswerPlan(
        "choice", grammar, tools, call_prefix=CALL_MARK, param="tools", parts=parts, free_text=False
    )


def _tools_plan(tools: tuple[Tool, ...], name: str | None, mode: str, native_tools: bool) -> AnswerPlan:
    if not tools:
        return AnswerPlan("text")
    by_name = {tool.name: tool for tool in tools}
    if name is not None or (mode == "required" and len(tools) == 1):
        tool = by_name[name] if name is not None else tools[0]
        grammar = Grammar("json", arguments_schema(tool))
        param = _tool_param(tool, tools)
        return AnswerPlan("args", grammar, tools, native_tools, tool.name, param=param, free_text=False)
    if mode == "required":
        grammar = Grammar("json", _call_schema(tools))
        parts = _tool_parts(tools)
        return AnswerPlan("call", grammar, tools, native_tools, param="tools", parts=parts, free_text=False)
    if native_tools:
        return AnswerPlan("native", None, tools, True)
    grammar = Grammar("lark", _choice_grammar(tools))
    return AnswerPlan("choice", grammar, tools, param="tools", parts=_tool_parts(tools))


def _tool_param(tool: Tool, tools: tuple[Tool, ...]) -> str:
    return tool.param or f"tools[{tools.index(tool)}]"


def _tool_parts(tools: tuple[Tool, ...]) -> tuple[tuple[Grammar, str], ...]:
    return tuple((Grammar("json", arguments_schema(tool)), _tool_param(tool, tools)) for tool in tools)


def prompt_messages(
    messages: tuple[Message, ...], plan: AnswerPlan, *, native_tools: bool
) -> tuple[Message, ...]:
    """The messages to render. A model with a tool format gets them as they are (its template
    renders calls and results); one without gets the tools described in a system note, past calls
    as the JSON it would write, and results as user turns."""
    if native_tools and (plan.offer_natively or not plan.tools):
        return messages
    plain = tuple(_plain(message, plan.call_prefix) for message in messages)
    if not plan.tools:
        return plain
    head = MARKED_TOOL_NOTE if plan.call_prefix else TOOL_NOTE
    note = head + "\n".join(_describe(tool) for tool in plan.tools)
    if plain and plain[0].role == "system":
        return (replace(plain[0], content=f"{plain[0].content}\n\n{note}"), *plain[1:])
    return (Message("system", note), *plain)


def call_text(name: str, arguments: str) -> str:
    """A call as a model without a tool format writes it (and as "call" and "choice" read it)."""
    return json.dumps({"name": name, "arguments": _loads_or_text(arguments)}, ensure_ascii=False)


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """Tools in the shape chat templates expect (OpenAI's function tools)."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": json.loads(tool.parameters),
            },
        }
        for tool in tools
    ]


def template_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """Messages in the shape chat templates expect, tool calls and results included."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _loads_or_text(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id or ""
            if message.name:
                item["name"] = message.name
        rendered.append(item)
    return rendered


def _plain(message: Message, prefix: str = "") -> Message:
    if message.tool_calls:
        calls = "\n".join(prefix + call_text(call.name, call.arguments) for call in message.tool_calls)
        content = f"{message.content}\n{calls}" if message.content else calls
        return Message("assistant", content)
    if message.role == "tool":
        label = f"Function {message.name} returned" if message.name else "The function returned"
        return Message("user", f"{label}:\n{message.content}")
    return message


def _describe(tool: Tool) -> str:
    entry = {"name": tool.name, "description": tool.description, "parameters": json.loads(tool.parameters)}
    return json.dumps(entry, ensure_ascii=False)


def arguments_schema(tool: Tool) -> str:
    """The schema a call's arguments are decoded under: the tool's own, with every object that
    lists its properties closed to others (JSON Schema allows extra ones unless told not to, and
    a small model given that freedom invents arguments until max_tokens)."""
    return json.dumps({**_closed(json.loads(tool.parameters)), "x-guidance": TOOL_GUIDANCE})


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {key: _closed(value) if key in _SUBSCHEMAS else value for key, value in node.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _closed(sub) for name, sub in closed[key].items()}
    if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "allOf", "prefixItems", "not", "if", "then", "else"})


def _call_schema(tools: tuple[Tool, ...]) -> str:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": json.loads(arguments_schema(tool))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**schema, "x-guidance": TOOL_GUIDANCE})


def _choice_grammar(tools: tuple[Tool, ...]) -> str:
    # Either an answer whose first character is not "{", or exactly one call object.
    return f"start: TEXT | call\nTEXT: /[^{{](.|\\n)*/\ncall: %json {_call_schema(tools)}\n"


def _marked_choice_grammar(tools: tuple[Tool, ...], answer: Grammar) -> str:
    # One marked call object, or the JSON answer (which never starts with "<").
    call = json.dumps(CALL_MARK)
    return f"start: call | answer\ncall: {call} %json {_call_schema(tools)}\nanswer: %json {_answer_schema(answer)}\n"


def _native_choice_grammar(
    tools: tuple[Tool, ...], answer: Grammar, markers: tuple[str, str], single: bool
) -> str:
    # The model's own call format (as its template renders calls), or the JSON answer.
    start, end = markers
    calls = "call" if single else "call+"  # back to back: no text between two calls
    return (
        f"start: calls | answer\ncalls: {calls}\n"
        f'call: {start} "\\n" %json {_call_schema(tools)} "\\n" {end}\n'
        f"answer: %json {_answer_schema(answer)}\n"
    )


def _answer_schema(answer: Grammar) -> str:
    return json.dumps({**json.loads(answer.source), "x-guidance": ANSWER_GUIDANCE})


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
