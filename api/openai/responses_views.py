"""OpenAI Responses endpoints: create (with continuations), retrieve, delete, cancel, input items."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from api.auth import api_endpoint, caller_of
from api.openai.input_items import IMAGE_URL_INCLUDE, input_items, input_items_page
from api.openai.responses import ResponseTurn, response_collect, response_shape, response_sse
from api.openai.responses_input import ENGINE_NAMES, ResponsesInput, response_request
from api.openai.views import body_for_turn, sse_response, validated
from api.tools import ToolSet
from mlxhost.engine import Usage
from mlxhost.wire import json_response
from models_app.catalogue import services
from models_app.models import StoredResponse
from models_app.persistence.persistence import persistence
from models_app.turns.response_turns import not_found, response_start
from models_app.turns.response_turns import response_cancel as cancel_response

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse, HttpResponseBase


@api_endpoint(dialect="openai", methods=("POST",), names=ENGINE_NAMES)
async def responses_create(request: HttpRequest) -> HttpResponseBase:
    """POST /v1/responses (OpenAI-compatible; continues a stored chain by `previous_response_id`)."""
    data = validated(ResponsesInput, await body_for_turn(request))
    caller = caller_of(request)
    started = await response_start(response_request(data), caller.owner_id, key=caller.key)
    response = response_shape(data, started)
    tools = data.get("tools") or ToolSet()
    if data["stream"]:
        stream = response_sse(response, started.turn)
        return sse_response(stream, {**started.turn.headers, **tools.headers()}, surface="responses")
    return json_response(
        await response_collect(response, started.turn), headers={**started.turn.headers, **tools.headers()}
    )


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
        output=list(row.output or []) if row.status != StoredResponse.Status.FAILED else [],
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
        return await persistence().fetch(public_id=public_id, owner_id=caller_of(request).owner_id)
    except StoredResponse.DoesNotExist:
        raise not_found() from None


@api_endpoint(dialect="openai", methods=("GET", "DELETE"))
async def response_detail(request: HttpRequest, public_id: str) -> HttpResponse:
    """GET /v1/responses/{id} and DELETE /v1/responses/{id}, scoped to the caller (PER-6)."""
    row = await _owned(request, public_id)
    if request.method == "DELETE":
        await sync_to_async(services.response_delete)(public_id=row.public_id, owner_id=row.owner_id)
        return json_response({"id": public_id, "object": "response.deleted", "deleted": True})
    return json_response(_stored_body(row))


@api_endpoint(dialect="openai", methods=("POST",))
async def response_cancel(request: HttpRequest, public_id: str) -> HttpResponse:
    """POST /v1/responses/{id}/cancel: stop a queued or running response of the caller's, on
    whichever host runs it (LANE-6)."""
    if await cancel_response(public_id=public_id, owner_id=caller_of(request).owner_id):
        return json_response({"id": public_id, "object": "response", "status": "cancelled"})
    return json_response(_stored_body(await _owned(request, public_id)))


@api_endpoint(dialect="openai", methods=("GET",))
async def response_input_items(request: HttpRequest, public_id: str) -> HttpResponse:
    """GET /v1/responses/{id}/input_items: this turn's input as message items, paged like OpenAI's
    (`order`, `limit`, `after`, `before`); an image's data URL only with
    `include=message.input_image.image_url`, as OpenAI's."""
    row = await _owned(request, public_id)
    with_urls = IMAGE_URL_INCLUDE in request.GET.getlist("include") + request.GET.getlist("include[]")
    items = input_items(row.public_id, (row.request or {}).get("input", []), image_urls=with_urls)
    return json_response(input_items_page(items, request.GET))
