"""OpenAI-compatible endpoints: POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from api.anthropic.models import model_info, model_page, wants_anthropic
from api.auth import Caller, api_endpoint, caller_of, json_body, request_context
from api.errors import ApiError, as_api_error, error_body
from api.openai.chat import ChatTurn, chat_complete, chat_sse
from api.openai.serializers import ChatCompletionInput, first_error
from api.sampling import sampling_overrides
from api.sse import SSE_DONE, sse_comment, sse_event, with_keepalive
from api.tools import ToolSet
from mlxhost import wire
from mlxhost.engine import ToolChoice
from mlxhost.runtime import engine_if_started
from mlxhost.wire import json_response
from models_app.catalogue import selectors
from models_app.models import ModelAlias
from models_app.turns.turns import CacheScope, StartedTurn, TurnRequest, turn_refuse_if_full, turn_start

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from rest_framework import serializers

    from mlxhost.engine import Generation, Message

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Whose error event ends a stream: chat and completions (`data: {"error":...}` then [DONE]),
# Anthropic Messages (`event: error`), Responses (`event: error`, its flat error object).
SseSurface = Literal["chat", "anthropic", "responses"]


def sse_response(
    frames: AsyncIterator[bytes],
    headers: dict[str, str],
    *,
    beat: bytes | None = None,
    surface: SseSurface = "chat",
) -> StreamingHttpResponse:
    """An SSE answer with keep-alives (`beat`, an SSE comment by default) while the stream idles;
    a frame that cannot be written as JSON ends it with `surface`'s error event."""
    written = _written(frames, surface)
    keepalive = with_keepalive(written, beat or sse_comment(), settings.MLXHOST_SSE_KEEPALIVE_S)
    return StreamingHttpResponse(
        keepalive, content_type="text/event-stream", headers={**SSE_HEADERS, **headers}
    )


async def _written(frames: AsyncIterator[bytes], surface: SseSurface) -> AsyncIterator[bytes]:
    # A NaN or Infinity in an answer is a server fault: the client hears a clean 500 error event
    # in the surface's shape (the traceback goes to the log), never a frame JSON.parse rejects.
    try:
        async for frame in frames:
            yield frame
    except wire.NotJSONError as exc:
        error = as_api_error(exc)
        if surface == "anthropic":
            yield sse_event(error_body(error, "anthropic"), event="error")
        elif surface == "responses":
            body = {"type": "error", "code": error.code, "message": error.message, "param": None}
            yield sse_event(body, event="error")
        else:
            yield sse_event(error_body(error, "openai"))
            yield SSE_DONE


def validated(serializer_class: type[serializers.Serializer[Any]], body: dict[str, Any]) -> dict[str, Any]:
    """Run a DRF serializer for validation only; the first error becomes a 400 with its `param`."""
    serializer = serializer_class(data=body)
    if not serializer.is_valid():
        param, message = first_error(serializer.errors)
        raise ApiError(
            400, f"{param}: {message}" if param else message, code="invalid_value", param=param or None
        )
    data: dict[str, Any] = serializer.validated_data
    return data


async def body_for_turn(request: HttpRequest) -> dict[str, Any]:
    """The JSON body of a request that starts a turn, refused first when the lane of the model
    it names is full: a burst's refusals cost no validation (LANE-2).

    Raises:
        ApiError: as `json_body` does.
        QueueFullError, DrainingError: as `turn_refuse_if_full` does.
    """
    body = json_body(request)
    caller = caller_of(request)
    await turn_refuse_if_full(body.get("model"), caller.key, owner_id=caller.owner_id)
    return body


def _chat_turn(data: dict[str, Any], caller: Caller) -> TurnRequest:
    messages: tuple[Message, ...] = tuple(m["message"] for m in data["messages"])
    # Stateless: no previous id, so the engine reuses the longest cached prefix in this
    # tenant's (and salt's) cache domain (SES-8), or the prompt_cache_key's session (SES-2).
    cache = CacheScope(
        salt=data.get("cache_salt"),
        prompt_cache_key=data.get("prompt_cache_key"),
        instructions="\n".join(m.content for m in messages if m.role == "system"),
    )
    return TurnRequest(
        data["model"],
        caller.owner_id,
        sampling_overrides(data),
        messages=messages,
        cache=cache,
        tools=(data.get("tools") or ToolSet()).tools,
        tool_choice=replace(
            data.get("tool_choice") or ToolChoice(), single=data.get("parallel_tool_calls") is False
        ),
        json_format=data.get("response_format"),
        effort=data.get("reasoning_effort"),
        key=caller.key,
        prediction=data.get("prediction"),
    )


@api_endpoint(dialect="openai", methods=("POST",))
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    """POST /v1/chat/completions (OpenAI-compatible; SSE when `stream` is true)."""
    data = validated(ChatCompletionInput, await body_for_turn(request))
    # Admitted before any header goes out, so a queue timeout or drain is a 503 (LANE-7/8).
    turn = await turn_start(
        _chat_turn(data, caller_of(request)),
        request_id=f"chatcmpl-{secrets.token_hex(12)}",
        choices=data["n"],
    )
    return await chat_shaped_response(data, turn, stream=chat_sse, collect=chat_complete)


async def chat_shaped_response(
    data: dict[str, Any],
    turn: StartedTurn,
    *,
    stream: Callable[[ChatTurn, Sequence[Generation]], AsyncIterator[bytes]],
    collect: Callable[[ChatTurn, Sequence[Generation]], Awaitable[dict[str, Any]]],
) -> HttpResponseBase:
    """The answer of an admitted chat or text completion (all its choices): SSE chunks, or one
    JSON body."""
    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
    generation = turn.generation
    shape = ChatTurn(
        id=turn.request_id, model=turn.model, instance_id=generation.instance_id, include_usage=include_usage
    )
    if data["stream"]:
        return sse_response(stream(shape, turn.generations), turn.headers)
    return json_response(await collect(shape, turn.generations), headers=turn.headers)


def _engine_states() -> dict[int, str]:
    # On the event loop, never in a thread: the lanes and session maps it walks are loop-owned,
    # and a thread could see them change mid-iteration (REG-8).
    engine = engine_if_started()
    return {snap["instance_id"]: snap["state"] for snap in engine.snapshot()} if engine else {}


def _state_of(instance_id: int | None, states: dict[int, str]) -> str:
    return states.get(instance_id, "unloaded") if instance_id is not None else "unloaded"


def _model_list(states: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {
            "id": alias.name,
            "object": "model",
            "created": int(alias.created_at.timestamp()),
            "owned_by": "mlxhost",
            "instance_id": alias.instance_id,
            "state": _state_of(alias.instance_id, states),
        }
        for alias in selectors.aliases_enabled()
    ]


@api_endpoint(dialect="auto", methods=("GET",))
async def models_list(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: enabled aliases in OpenAI's list shape, with load state (REG-8); in
    Anthropic's page shape for a request with `anthropic-version` (API-2)."""
    items = await sync_to_async(_model_list)(_engine_states())
    if wants_anthropic(request):
        return json_response(model_page(items))
    return json_response({"object": "list", "data": items})


@api_endpoint(dialect="auto", methods=("GET",))
async def model_retrieve(request: HttpRequest, name: str) -> HttpResponse:
    """GET /v1/models/{name}, in Anthropic's shape for a request with `anthropic-version`."""
    request_context(request).requested_model = name
    for item in await sync_to_async(_model_list)(_engine_states()):
        if item["id"] == name:
            return json_response(model_info(item) if wants_anthropic(request) else item)
    raise ModelAlias.DoesNotExist
