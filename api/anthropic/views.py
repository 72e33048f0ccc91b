"""Anthropic-compatible endpoints: POST /v1/messages and POST /v1/messages/count_tokens (API-2)."""

from __future__ import annotations

import secrets
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from api import lookups
from api.anthropic.messages import MessageTurn, message_complete, message_sse
from api.anthropic.serializers import CountTokensInput, MessagesInput
from api.auth import api_endpoint, json_body
from api.openai.views import SSE_HEADERS, validated
from mlxhost.engine import Engine, GenerationRequest, Message
from mlxhost.runtime.control import engine_for
from models_app import selectors
from models_app.models import ModelAlias

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens")  # merged over the alias defaults


def _messages_request(
    alias: ModelAlias, data: dict[str, Any], request_id: str, tenant: str, engine: Engine
) -> GenerationRequest:
    # No database access: alias_resolve already joined the instance, so this runs on the loop.
    system = data["system"]
    messages = ((Message(role="system", content=system),) if system else ()) + tuple(
        Message(role=m["role"], content=m["content"]) for m in data["messages"]
    )
    overrides = {name: data.get(name) for name in SAMPLING_FIELDS}
    overrides["stop"] = data.get("stop_sequences") or []
    # Stateless like chat, but Anthropic clients never name a session: any warm slot of the
    # instance with the same system prompt (SES-2 tier 3), then the longest cached prefix (SES-8).
    session = engine.scoper.query(tenant=tenant, salt=None, instructions=system, warm_any=True)
    return GenerationRequest(
        request_id=request_id,
        sampling=selectors.sampling_params_for(alias=alias, overrides=overrides),
        messages=messages,
        binding=alias.name,
        max_input_tokens=alias.max_input_tokens,
        session=session,
    )


async def _resolve(request: HttpRequest, serializer: type) -> tuple[ModelAlias, dict[str, Any]]:
    body = json_body(request)
    data = validated(serializer, body)
    alias = await lookups.alias_resolve(data["model"])
    return alias, data


@api_endpoint(dialect="anthropic", methods=("POST",))
async def messages(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages (Anthropic-compatible; SSE events when `stream` is true).

    `anthropic-version` and `anthropic-beta` headers are accepted and ignored.
    """
    alias, data = await _resolve(request, MessagesInput)
    request_id = f"msg_{secrets.token_hex(12)}"
    engine = await engine_for(alias.name)
    tenant = str(request.tenant_id)  # type: ignore[attr-defined]
    generation = await engine.submit(_messages_request(alias, data, request_id, tenant, engine))
    # Wait for a slot before any header goes out, so a queue timeout or drain is a status code.
    await generation.admitted()
    turn = MessageTurn(id=request_id, model=alias.name)
    headers = {
        "X-Session-Cache": generation.session_outcome,
        "X-Request-Id": request_id,
        "request-id": request_id,
    }
    if data["stream"]:
        return StreamingHttpResponse(
            message_sse(turn, generation),
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    return JsonResponse(await message_complete(turn, generation), headers=headers)


@api_endpoint(dialect="anthropic", methods=("POST",))
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """POST /v1/messages/count_tokens: the prompt's token count, without generating or queueing."""
    alias, data = await _resolve(request, CountTokensInput)
    engine = await engine_for(alias.name)
    tenant = str(request.tenant_id)  # type: ignore[attr-defined]
    prompt = _messages_request(alias, data, "count", tenant, engine)
    return JsonResponse({"input_tokens": await engine.count_tokens(prompt)})
