"""Anthropic-compatible endpoints: POST /v1/messages and POST /v1/messages/count_tokens (API-2)."""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from api.anthropic.messages import MessageTurn, message_complete, message_sse
from api.anthropic.serializers import CountTokensInput, MessagesInput
from api.auth import Caller, api_endpoint, caller_of, json_body
from api.openai.views import body_for_turn, sse_response, validated
from api.sampling import sampling_overrides
from api.sse import anthropic_ping
from api.tools import ToolSet
from mlxhost.engine import Message, ToolChoice
from mlxhost.wire import json_response
from models_app.turns.turns import CacheScope, TurnRequest, turn_count_tokens, turn_start

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse, HttpResponseBase

# Anthropic's tool_use ids start so; clients and their tests check it (OpenAI's are "call_").
TOOL_USE_ID_PREFIX = "toolu_"

# The engine's field names, as Messages spells them (`api.auth.in_wire_names`); a format error
# names `output_config.format`, the beta's `output_format` being its older name.
ENGINE_NAMES = {"response_format": "output_config.format", "stop": "stop_sequences"}


def _messages_turn(data: dict[str, Any], caller: Caller) -> TurnRequest:
    system = data["system"]
    names: dict[str, str] = {}  # tool_use id -> name, so a result names its function
    turns: list[Message] = []
    for message in (m for turn in data["messages"] for m in turn["turn"]):
        names.update((call.id, call.name) for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id in names:
            message = replace(message, name=names[message.tool_call_id])
        turns.append(message)
    messages = ((Message(role="system", content=system),) if system else ()) + tuple(turns)
    # Stateless like chat, but Anthropic clients never name a session: any warm slot of the
    # instance with the same system prompt (SES-2 tier 3), then the longest cached prefix (SES-8).
    cache = CacheScope(instructions=system, warm_any=True)
    # A final assistant message is a prefill: the answer continues it, as Anthropic's does.
    prefill = data["messages"][-1]["role"] == "assistant"
    return TurnRequest(
        data["model"],
        caller.owner_id,
        sampling_overrides(data),
        messages=messages,
        cache=cache,
        continue_final=prefill,
        tools=(data.get("tools") or ToolSet()).tools,
        tool_choice=data.get("tool_choice") or ToolChoice(),
        json_format=data.get("json_format"),
        format_param=_format_param(data),
        thinking=data.get("thinking_switch"),
        effort=data.get("effort"),
        key=caller.key,
        call_id_prefix=TOOL_USE_ID_PREFIX,
    )


def _format_param(data: dict[str, Any]) -> str:
    # `output_config.format` wins over the older beta's `output_format` (serializers.py).
    return (
        "output_config.format"
        if (data.get("output_config") or {}).get("format") is not None
        else "output_format"
    )


@api_endpoint(dialect="anthropic", methods=("POST",), names=ENGINE_NAMES)
async def messages(request: HttpRequest) -> HttpResponseBase:
    """POST /v1/messages (Anthropic-compatible; SSE events when `stream` is true).

    `anthropic-version` and `anthropic-beta` headers are accepted and ignored.
    """
    data = validated(MessagesInput, await body_for_turn(request))
    # Admitted before any header goes out, so a queue timeout or drain is a status code.
    turn = await turn_start(
        _messages_turn(data, caller_of(request)), request_id=f"msg_{secrets.token_hex(12)}"
    )
    shape = MessageTurn(id=turn.request_id, model=turn.model, thinking=data["thinking_enabled"])
    headers = {**turn.headers, "request-id": turn.request_id, **(data.get("tools") or ToolSet()).headers()}
    if data["stream"]:
        return sse_response(
            message_sse(shape, turn.generation), headers, beat=anthropic_ping(), surface="anthropic"
        )
    return json_response(await message_complete(shape, turn.generation), headers=headers)


@api_endpoint(dialect="anthropic", methods=("POST",), names=ENGINE_NAMES)
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages/count_tokens: the prompt's token count, without generating or queueing."""
    data = validated(CountTokensInput, json_body(request))
    return json_response({"input_tokens": await turn_count_tokens(_messages_turn(data, caller_of(request)))})
