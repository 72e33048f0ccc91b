"""OpenAI Responses endpoints: create (with continuations), retrieve, delete, cancel, input items."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from api.auth import api_endpoint, json_body
from api.engine_client import BOOT_ID, get_engine
from api.errors import ApiError
from api.openai.responses import ResponseTurn, response_collect, response_sse, usage_body
from api.openai.responses_input import ResponsesInput
from api.openai.views import SSE_HEADERS, validated
from mlxhost.engine import Engine, GenerationRequest, Message, Usage
from mlxhost.engine.instance import Instance
from models_app import conversations, selectors
from models_app.models import ModelAlias, StoredResponse
from models_app.persistence import ResponseRecord, persistence

# The id is not echoed: a foreign id and a missing one answer the very same bytes (PER-6).
NOT_FOUND = "No response found with that id."
WEIGHTS_CHANGED = (
    "The model {model!r} now serves different weights than the ones that produced {id!r}; "
    "start a new conversation."
)
NOT_CONTINUABLE = "Response {id!r} failed, so it cannot be continued."

# Responses being generated in this process -> their tenant, so cancel is tenant-scoped too.
_live_owners: dict[str, int] = {}


@dataclass
class Turn:
    """Everything one create call resolved before it reaches the engine."""

    alias: ModelAlias
    data: dict[str, Any]
    tenant: int
    instructions: str | None
    history: list[dict[str, str]]  # earlier turns, through the parent's answer
    parent: StoredResponse | None

    @property
    def conversation(self) -> list[dict[str, str]]:
        return [*self.history, *(t for t in self.data["turns"] if t["role"] != "system")]

    def messages(self) -> tuple[Message, ...]:
        system = [t["content"] for t in self.data["turns"] if t["role"] == "system"]
        instructions = "\n".join([self.instructions, *system] if self.instructions else system)
        head = (Message(role="system", content=instructions),) if instructions else ()
        return head + tuple(Message(role=t["role"], content=t["content"]) for t in self.conversation)  # type: ignore[arg-type]


def _not_found(public_id: str) -> ApiError:
    # Byte-identical for a missing id and another tenant's id (PER-6).
    return ApiError(404, NOT_FOUND, code="response_not_found", param="response_id")


async def _parent(data: dict[str, Any], tenant: int) -> StoredResponse | None:
    public_id = data.get("previous_response_id")
    if not public_id:
        return None
    try:
        parent = await persistence().fetch(public_id=public_id, owner_id=tenant)
    except StoredResponse.DoesNotExist:
        raise ApiError(404, NOT_FOUND, code="response_not_found", param="previous_response_id") from None
    if parent.status not in conversations.CONTINUABLE:
        raise ApiError(400, NOT_CONTINUABLE.format(id=public_id), param="previous_response_id")
    return parent


def _check_weights(turn: Turn, instance: Instance) -> None:
    parent = turn.parent
    if parent is None:
        return
    same = conversations.response_same_weights(
        parent=parent,
        live_instance_id=instance.instance_id,
        fingerprint=turn.alias.instance.fingerprint,  # type: ignore[union-attr]
        boot_id=BOOT_ID,
    )
    if not same:
        message = WEIGHTS_CHANGED.format(model=turn.alias.name, id=parent.public_id)
        raise ApiError(400, message, code="model_changed", param="previous_response_id")


def _generation_request(turn: Turn, request_id: str, engine: Engine) -> GenerationRequest:
    data = turn.data
    session = engine.scoper.query(
        tenant=str(turn.tenant),
        salt=data.get("cache_salt"),
        instructions=turn.instructions or "",
        previous_response_id=data.get("previous_response_id"),
        prompt_cache_key=data.get("prompt_cache_key"),
    )
    return GenerationRequest(
        request_id=request_id,
        model=selectors.model_spec_for(alias=turn.alias),
        sampling=selectors.sampling_params_for(alias=turn.alias, overrides=data),
        messages=turn.messages(),
        binding=turn.alias.name,
        session=session,
    )


def _on_end(turn: Turn, response: ResponseTurn, instance: Instance, engine: Engine) -> None:
    """The turn ended (answered, failed or hung up): store it, and let the instance go."""
    _live_owners.pop(response.id, None)
    if not response.store:
        engine.registry.unretain(instance)
        return
    data = turn.data
    record = ResponseRecord(
        public_id=response.id,
        owner_id=turn.tenant,
        alias_id=turn.alias.pk,
        alias_name=turn.alias.name,
        instance_id=instance.instance_id,
        weights_fingerprint=instance.spec.fingerprint,
        weights_key=list(instance.spec.weights_key),
        boot_id=BOOT_ID,
        previous_response_id=response.previous_response_id or "",
        request={
            "input": data["turns"],
            "instructions": turn.instructions,
            "conversation": turn.conversation,
            "metadata": response.metadata,
            "max_output_tokens": response.max_output_tokens,
            "temperature": response.temperature,
            "top_p": response.top_p,
        },
        output=[response.message_item(done=True)] if response.status != "failed" else [],
        output_text=response.text,
        usage=usage_body(response.usage) or {},
        status=response.status,
        retention_s=data.get("retention_s") or 0,
        created_at=float(response.created_at),
    )
    weights_key = instance.spec.weights_key
    persistence().record(
        record,
        on_settled=lambda: engine.registry.unretain(instance),
        on_force_release=lambda: engine.registry.retire_for_force_release(instance),
        on_late_landing=lambda: engine.registry.release_tombstone(weights_key),
    )


@api_endpoint(dialect="openai", methods=("POST",))
async def responses_create(request: HttpRequest) -> HttpResponse:
    """POST /v1/responses (OpenAI-compatible; continues a stored chain by `previous_response_id`)."""
    body = json_body(request)
    request.requested_model = body.get("model") if isinstance(body.get("model"), str) else None  # type: ignore[attr-defined]
    data = validated(ResponsesInput, body)
    tenant: int = request.tenant_id  # type: ignore[attr-defined]
    alias = await sync_to_async(selectors.alias_resolve)(name=data["model"])
    parent = await _parent(data, tenant)
    instructions, history = conversations.conversation_of(parent=parent) if parent else (None, [])
    if data.get("instructions") is not None:
        instructions = data["instructions"]  # omitted: the chain's instructions carry over
    turn = Turn(alias, data, tenant, instructions, history, parent)
    engine = get_engine()
    instance = engine.bind(alias.name, selectors.model_spec_for(alias=alias))
    _check_weights(turn, instance)
    response_id = f"resp_{secrets.token_hex(16)}"
    # Retained from now until the row lands, so the instance outlives its pending persist (REG-6).
    engine.registry.retain(instance)
    try:
        generation = await engine.submit(_generation_request(turn, response_id, engine))
        _live_owners[response_id] = tenant
        await generation.admitted()
    except BaseException:
        _live_owners.pop(response_id, None)
        engine.registry.unretain(instance)
        raise
    response = ResponseTurn(
        id=response_id,
        model=alias.name,
        instructions=instructions,
        previous_response_id=data.get("previous_response_id"),
        store=data["store"],
        max_output_tokens=data.get("max_output_tokens"),
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        metadata=data.get("metadata") or {},
    )
    on_end = lambda r: _on_end(turn, r, instance, engine)  # noqa: E731
    headers = {"X-Session-Cache": generation.session_outcome, "X-Request-Id": response_id}
    if data["stream"]:
        stream = response_sse(response, generation, on_end)
        return StreamingHttpResponse(
            stream, content_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )
    return JsonResponse(await response_collect(response, generation, on_end), headers=headers)


def _stored_body(row: StoredResponse) -> dict[str, Any]:
    request = row.request or {}
    turn = ResponseTurn(
        id=row.public_id,
        model=row.alias_name,
        instructions=request.get("instructions"),
        previous_response_id=row.previous_response_id or None,
        store=True,
        max_output_tokens=request.get("max_output_tokens"),
        temperature=request.get("temperature"),
        top_p=request.get("top_p"),
        metadata=request.get("metadata") or {},
        created_at=int(row.created_at.timestamp()),
        status=row.status,
        text=row.output_text,
    )
    usage = row.usage or {}
    if usage:
        turn.usage = Usage(
            prompt_tokens=usage.get("input_tokens", 0),
            completion_tokens=usage.get("output_tokens", 0),
            cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
        )
    if row.status == StoredResponse.Status.INCOMPLETE:
        turn.incomplete_reason = "max_output_tokens"
    if row.status == StoredResponse.Status.FAILED:
        turn.error = {"code": "generation_failed", "message": "The model failed while generating."}
    return turn.body()


async def _owned(request: HttpRequest, public_id: str) -> StoredResponse:
    try:
        return await persistence().fetch(public_id=public_id, owner_id=request.tenant_id)  # type: ignore[attr-defined]
    except StoredResponse.DoesNotExist:
        raise _not_found(public_id) from None


@api_endpoint(dialect="openai", methods=("GET", "DELETE"))
async def response_detail(request: HttpRequest, public_id: str) -> HttpResponse:
    """GET /v1/responses/{id} and DELETE /v1/responses/{id}, scoped to the caller (PER-6)."""
    row = await _owned(request, public_id)
    if request.method == "DELETE":
        await StoredResponse.objects.filter(pk=row.pk).adelete()
        return JsonResponse({"id": public_id, "object": "response.deleted", "deleted": True})
    return JsonResponse(_stored_body(row))


@api_endpoint(dialect="openai", methods=("POST",))
async def response_cancel(request: HttpRequest, public_id: str) -> HttpResponse:
    """POST /v1/responses/{id}/cancel: stop a queued or running response of the caller's (LANE-6)."""
    if _live_owners.get(public_id) == request.tenant_id:  # type: ignore[attr-defined]
        get_engine().cancel(public_id)
        return JsonResponse({"id": public_id, "object": "response", "status": "cancelled"})
    return JsonResponse(_stored_body(await _owned(request, public_id)))


@api_endpoint(dialect="openai", methods=("GET",))
async def response_input_items(request: HttpRequest, public_id: str) -> HttpResponse:
    """GET /v1/responses/{id}/input_items: this turn's input, as message items."""
    row = await _owned(request, public_id)
    items = [
        {
            "type": "message",
            "id": f"msg_{public_id.removeprefix('resp_')}_{index}",
            "role": turn["role"],
            "status": "completed",
            "content": [{"type": "input_text", "text": turn["content"]}],
        }
        for index, turn in enumerate((row.request or {}).get("input", []))
    ]
    first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
    return JsonResponse(
        {"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": False}
    )
