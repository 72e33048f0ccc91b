"""One Responses turn, from a validated body to a running generation: shared by
`POST /v1/responses` (SSE or JSON) and the `/ws/v1/responses` socket (API-1, API-3)."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from api import lookups
from api.errors import ApiError
from api.openai.responses import Handoff, OnEnd, ResponseTurn, usage_body
from mlxhost.engine import Engine, Generation, GenerationRequest, Message
from mlxhost.engine.instance import Instance
from mlxhost.runtime import BOOT_ID
from mlxhost.runtime.control import engine_for
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


def not_found() -> ApiError:
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
        sampling=selectors.sampling_params_for(alias=turn.alias, overrides=data),
        messages=turn.messages(),
        binding=turn.alias.name,
        max_input_tokens=turn.alias.max_input_tokens,
        session=session,
    )


def _on_end(turn: Turn, response: ResponseTurn, instance: Instance, engine: Engine) -> Handoff | None:
    """The turn ended (answered, failed or hung up): store it, and let the instance go.

    Returns the persist handoff for a stored turn (None when `store` is false), which the caller
    awaits before it sends the terminal event (PER-1, issue 10 item 5).
    """
    _live_owners.pop(response.id, None)
    if not response.store:
        engine.registry.unretain(instance)
        return None
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
    return persistence().record(
        record,
        on_settled=lambda: engine.registry.unretain(instance),
        on_force_release=lambda: engine.registry.retire_for_force_release(instance),
        on_late_landing=lambda: engine.registry.release_tombstone(weights_key),
    )


@dataclass
class StartedResponse:
    """A turn the lane admitted: what it will say, its events, and what runs when it ends."""

    response: ResponseTurn
    generation: Generation
    on_end: OnEnd

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Cache": self.generation.session_outcome, "X-Request-Id": self.response.id}


def live_owner(response_id: str) -> int | None:
    """The tenant of a response being generated in this process (for a tenant-scoped cancel)."""
    return _live_owners.get(response_id)


async def response_start(
    data: dict[str, Any],
    tenant: int,
    *,
    response_id: str | None = None,
    on_queued: Callable[[int], Awaitable[None]] | None = None,
) -> StartedResponse:
    """Resolve the alias, take a lane permit, load the stored chain, check the weights, submit,
    and wait for admission.

    The permit comes before the chain (LANE-3): loading it may wait up to 2 s for a pending
    write (PER-2), and that wait must count against the lane's budget; a full lane answers 429
    before any 404, 400 or 503 about the parent.

    `data` is a validated `ResponsesInput`. `on_queued` hears each queue position while the
    turn waits (the WebSocket shows them); without it the wait is silent.

    Raises:
        ApiError: the parent is missing, failed, or came from other weights (REG-4).
        EngineError: refused by the lane or the engine (429/503 via the error table).
        ModelAlias.DoesNotExist: no enabled alias has that name.
    """
    alias = await lookups.alias_resolve(data["model"])
    engine = await engine_for(alias.name)
    response_id = response_id or f"resp_{secrets.token_hex(16)}"
    permit = engine.reserve(response_id, alias.name)
    try:
        parent = await _parent(data, tenant)
        instructions, history = conversations.conversation_of(parent=parent) if parent else (None, [])
        if data.get("instructions") is not None:
            instructions = data["instructions"]  # omitted: the chain's instructions carry over
        turn = Turn(alias, data, tenant, instructions, history, parent)
        instance = engine.get(permit.instance_id)
        _check_weights(turn, instance)
    except BaseException:
        permit.release()  # idempotent; the place goes back to the lane (LANE-3)
        raise
    # Retained from now until the row lands, so the instance outlives its pending persist (REG-6).
    engine.registry.retain(instance)
    generation: Generation | None = None
    try:
        generation = await engine.submit(_generation_request(turn, response_id, engine), permit)
        _live_owners[response_id] = tenant
        if on_queued is None:
            await generation.admitted()
        else:
            async for position in generation.queue_positions():
                await on_queued(position)
    except BaseException:
        if generation is not None:
            # The caller gave up while it waited (a socket that closed under a queue-position
            # frame): cancel, or the waiter would later run its whole answer for nobody (LANE-6).
            generation.cancel()
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
    return StartedResponse(response, generation, lambda r: _on_end(turn, r, instance, engine))
